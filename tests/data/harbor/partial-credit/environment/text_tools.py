def shout(s):
    return s.upper() + "!"


def initials(name):
    return "".join(word[0] for word in name.split())


def count_vowels(s):
    return sum(1 for ch in s if ch in "aeiou")


def reverse_words(s):
    return " ".join(reversed(s.split()))
