def double(x):
    return x + 1
