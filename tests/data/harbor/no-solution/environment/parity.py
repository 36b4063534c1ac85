def is_even(n):
    return n > 0 and n % 2 == 0
