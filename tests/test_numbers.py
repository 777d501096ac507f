"""Tests for the built-in English->German numbers corpus."""

import random

import pytest

from transformer_jax.data import numbers
from transformer_jax.errors import ConfigError

KNOWN = [
    (0, 'zero', 'null', 'null'),
    (1, 'one', 'eins', 'eins'),
    (7, 'seven', 'sieben', 'sieben'),
    (13, 'thirteen', 'dreizehn', 'dreizehn'),
    (16, 'sixteen', 'sechzehn', 'sechzehn'),
    (21, 'twenty-one', 'ein und zwanzig', 'einundzwanzig'),
    (30, 'thirty', 'dreißig', 'dreißig'),
    (42, 'forty-two', 'zwei und vierzig', 'zweiundvierzig'),
    (77, 'seventy-seven', 'sieben und siebzig', 'siebenundsiebzig'),
    (100, 'one hundred', 'ein hundert', 'einhundert'),
    (101, 'one hundred one', 'ein hundert eins', 'einhunderteins'),
    (999, 'nine hundred ninety-nine', 'neun hundert neun und neunzig', 'neunhundertneunundneunzig'),
    (1000, 'one thousand', 'ein tausend', 'eintausend'),
    (1001, 'one thousand one', 'ein tausend eins', 'eintausendeins'),
    (21042, 'twenty-one thousand forty-two', 'ein und zwanzig tausend zwei und vierzig',
     'einundzwanzigtausendzweiundvierzig'),
    (101001, 'one hundred one thousand one', 'ein hundert ein tausend eins',
     'einhunderteintausendeins'),
    (999999, 'nine hundred ninety-nine thousand nine hundred ninety-nine',
     'neun hundert neun und neunzig tausend neun hundert neun und neunzig',
     'neunhundertneunundneunzigtausendneunhundertneunundneunzig'),
]

# Word values for an independent parser: summing the parts works in both languages
# ("zwei und vierzig" = 2 + 40), with "hundert" multiplying and "tausend" closing a group.
_EN_VALUES = dict(
    zip([
        'zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine', 'ten',
        'eleven', 'twelve', 'thirteen', 'fourteen', 'fifteen', 'sixteen', 'seventeen', 'eighteen',
        'nineteen'
    ], range(20)))
_EN_VALUES.update({
    'twenty': 20, 'thirty': 30, 'forty': 40, 'fifty': 50, 'sixty': 60, 'seventy': 70, 'eighty': 80,
    'ninety': 90
})
_DE_VALUES = dict(
    zip([
        'null', 'eins', 'zwei', 'drei', 'vier', 'fünf', 'sechs', 'sieben', 'acht', 'neun', 'zehn',
        'elf', 'zwölf', 'dreizehn', 'vierzehn', 'fünfzehn', 'sechzehn', 'siebzehn', 'achtzehn',
        'neunzehn'
    ], range(20)))
_DE_VALUES.update({
    'ein': 1, 'und': 0, 'zwanzig': 20, 'dreißig': 30, 'vierzig': 40, 'fünfzig': 50, 'sechzig': 60,
    'siebzig': 70, 'achtzig': 80, 'neunzig': 90
})


def _parse(words: list[str], values: dict[str, int], hundred: str, thousand: str) -> int | None:
  """Reads the number in a sentence, ignoring non-number words; None if there is none."""
  total = current = 0
  found = False
  for word in words:
    parts = word.split('-')
    if word == hundred:
      current *= 100
    elif word == thousand:
      total, current = total + current * 1000, 0
    elif all(p in values for p in parts):
      current += sum(values[p] for p in parts)
    else:
      continue
    found = True
  return total + current if found else None


def parse_english(sentence: str) -> int | None:
  return _parse(sentence.split(), _EN_VALUES, 'hundred', 'thousand')


def parse_german(sentence: str) -> int | None:
  return _parse(sentence.split(), _DE_VALUES, 'hundert', 'tausend')


@pytest.mark.parametrize('n, english, german, compound', KNOWN)
def test_known_values(n, english, german, compound):
  assert numbers.number_to_english(n) == english
  assert numbers.number_to_german(n) == german
  assert numbers.number_to_german(n, compound=True) == compound


def test_random_numbers_parse_back():
  rng = random.Random(0)
  for n in [rng.randint(0, numbers.MAX_NUMBER) for _ in range(2000)] + list(range(200)):
    assert parse_english(numbers.number_to_english(n)) == n
    assert parse_german(numbers.number_to_german(n)) == n


@pytest.mark.parametrize('n', [-1, 1_000_000])
def test_out_of_range(n):
  with pytest.raises(ValueError):
    numbers.number_to_english(n)
  with pytest.raises(ValueError):
    numbers.number_to_german(n)


def test_corpus_is_deterministic_and_consistent():
  english, german = numbers.make_numbers_corpus(300, seed=3)
  assert (english, german) == numbers.make_numbers_corpus(300, seed=3)
  assert (english, german) != numbers.make_numbers_corpus(300, seed=4)
  assert len(english) == len(german) == 300
  values = []
  for en, de in zip(english, german):
    n = parse_english(en)
    assert n is not None and n == parse_german(de), (en, de)
    assert len(en.split()) <= 14 and len(de.split()) <= 14, (en, de)
    values.append(n)
  # Digit counts are drawn uniformly, so short and long numbers are both common.
  assert sum(v < 100 for v in values) > 50
  assert sum(v >= 100_000 for v in values) > 25


def test_one_is_never_followed_by_a_plural_noun():
  english, german = numbers.make_numbers_corpus(3000, seed=0)
  singles = [(en, de) for en, de in zip(english, german) if parse_english(en) == 1]
  assert singles
  for en, de in singles:
    assert en.split()[-1] == 'one' and de.split()[-1] == 'eins'


def test_splits_have_disjoint_numbers():
  splits = numbers.make_numbers_splits(seed=0, train=3000, valid=200, test=300)
  assert {k: len(v[0]) for k, v in splits.items()} == {'train': 3000, 'valid': 200, 'test': 300}
  values = {}
  for name, (english, german) in splits.items():
    assert len(english) == len(german)
    values[name] = [parse_english(en) for en in english]
    assert values[name] == [parse_german(de) for de in german]
  train, valid, test = (set(values[k]) for k in ('train', 'valid', 'test'))
  assert not train & valid and not train & test and not valid & test
  # Held-out numbers are distinct and at least 100 (0..99 are the task's vocabulary).
  assert len(valid) == 200 and len(test) == 300 and min(valid | test) >= 100
  assert numbers.make_numbers_splits(seed=0, train=3000, valid=200, test=300) == splits
  assert numbers.make_numbers_splits(seed=1, train=3000, valid=200, test=300) != splits


def test_splits_reject_impossible_sizes():
  with pytest.raises(ConfigError):
    numbers.make_numbers_splits(valid=-1)
  with pytest.raises(ConfigError):
    numbers.make_numbers_splits(valid=100_000, test=100_000)
