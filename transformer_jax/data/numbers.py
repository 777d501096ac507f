"""A built-in toy translation task: English number words to German number words.

It needs no download and a small Transformer learns it in minutes on a CPU, yet it
is not trivial: German says the units before the tens ("forty-two" is "zwei und
vierzig"), so the model must learn to reorder, not just to look words up.

German writes numbers below a million as one word ("zweiundvierzig"). We put a
space between the parts instead ("zwei und vierzig") because BLEU scores whole
words: with spaces a nearly right number earns partial credit instead of none.
Removing the spaces gives the correct German spelling (`compound=True`).

Numbers go from 0 to 999,999 and sit in short sentence templates such as
"i have forty-two apples" -> "ich habe zwei und vierzig äpfel".
"""

import random
from collections.abc import Callable

from transformer_jax.errors import ConfigError

MAX_NUMBER = 999_999
# Held-out numbers are distinct, so there must be far fewer than there are numbers.
_MAX_HELD_OUT = 100_000

_EN_ONES = [
    'zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine', 'ten', 'eleven',
    'twelve', 'thirteen', 'fourteen', 'fifteen', 'sixteen', 'seventeen', 'eighteen', 'nineteen'
]
_EN_TENS = ['', '', 'twenty', 'thirty', 'forty', 'fifty', 'sixty', 'seventy', 'eighty', 'ninety']

_DE_ONES = [
    'null', 'eins', 'zwei', 'drei', 'vier', 'fünf', 'sechs', 'sieben', 'acht', 'neun', 'zehn',
    'elf', 'zwölf', 'dreizehn', 'vierzehn', 'fünfzehn', 'sechzehn', 'siebzehn', 'achtzehn',
    'neunzehn'
]
_DE_TENS = [
    '', '', 'zwanzig', 'dreißig', 'vierzig', 'fünfzig', 'sechzig', 'siebzig', 'achtzig', 'neunzig'
]

# (English, German) plural nouns. All German nouns are lower-cased like the rest of
# the corpus, which keeps the vocabulary small.
_NOUNS = [
    ('apples', 'äpfel'),
    ('books', 'bücher'),
    ('cats', 'katzen'),
    ('dogs', 'hunde'),
    ('houses', 'häuser'),
    ('trees', 'bäume'),
    ('birds', 'vögel'),
    ('cars', 'autos'),
    ('children', 'kinder'),
    ('stones', 'steine'),
    ('flowers', 'blumen'),
    ('cups', 'tassen'),
]

# Sentence templates; {n} is the number and {noun} a plural noun.
_NOUN_TEMPLATES = [
    ('i have {n} {noun}', 'ich habe {n} {noun}'),
    ('we saw {n} {noun}', 'wir sahen {n} {noun}'),
    ('she bought {n} {noun}', 'sie kaufte {n} {noun}'),
    ('there are {n} {noun}', 'es gibt {n} {noun}'),
    ('{n} {noun}', '{n} {noun}'),
]
# Used for 1, where a plural noun would be wrong, and now and then for any number.
_NUMBER_TEMPLATES = [
    ('the number is {n}', 'die zahl ist {n}'),
    ('{n}', '{n}'),
]


def _check_range(n: int) -> None:
  if not 0 <= n <= MAX_NUMBER:
    raise ValueError(f'number {n} is outside the supported range 0..{MAX_NUMBER}')


def _english_below_1000(n: int) -> list[str]:
  """English words for 1 <= n <= 999, e.g. 342 -> ['three', 'hundred', 'forty-two']."""
  words = []
  hundreds, rest = divmod(n, 100)
  if hundreds:
    words += [_EN_ONES[hundreds], 'hundred']
  if rest >= 20:
    tens, ones = divmod(rest, 10)
    words.append(_EN_TENS[tens] + (f'-{_EN_ONES[ones]}' if ones else ''))
  elif rest:
    words.append(_EN_ONES[rest])
  return words


def _number_parts(n: int, zero: str, thousand: str, below_1000: Callable[[int, bool],
                                                                         list[str]]) -> list[str]:
  """The parts of 0 <= n <= 999,999: `zero`, or the thousands, `thousand`, then the rest, each
  written by below_1000(k, final), final = whether k ends the number."""
  _check_range(n)
  if n == 0:
    return [zero]
  thousands, rest = divmod(n, 1000)
  parts = []
  if thousands:
    parts += below_1000(thousands, False) + [thousand]
  if rest:
    parts += below_1000(rest, True)
  return parts


def number_to_english(n: int) -> str:
  """Writes 0 <= n <= 999,999 in American English words, e.g. "one hundred one"."""
  return ' '.join(_number_parts(n, _EN_ONES[0], 'thousand', lambda k, _: _english_below_1000(k)))


def _german_below_1000(n: int, *, final: bool) -> list[str]:
  """German parts for 1 <= n <= 999, e.g. 342 -> ['drei', 'hundert', 'zwei', 'und', 'vierzig'].

  A lone 1 is "eins" only at the very end of the number; before "hundert",
  "tausend" or "und" it is "ein" (einhundert, eintausend, einundzwanzig).
  """
  parts = []
  hundreds, rest = divmod(n, 100)
  if hundreds:
    # Always "ein hundert", never a bare "hundert": the regular pattern is easier to learn.
    parts += ['ein' if hundreds == 1 else _DE_ONES[hundreds], 'hundert']
  if rest >= 20:
    tens, ones = divmod(rest, 10)
    if ones:
      parts += ['ein' if ones == 1 else _DE_ONES[ones], 'und']
    parts.append(_DE_TENS[tens])
  elif rest == 1:
    parts.append('eins' if final else 'ein')
  elif rest:
    parts.append(_DE_ONES[rest])
  return parts


def number_to_german(n: int, *, compound: bool = False) -> str:
  """Writes 0 <= n <= 999,999 in German words.

  By default the parts are separated by spaces, e.g. 21042 -> "ein und zwanzig
  tausend zwei und vierzig"; with `compound=True` they are joined into the
  standard spelling "einundzwanzigtausendzweiundvierzig".
  """
  parts = _number_parts(n, _DE_ONES[0], 'tausend',
                        lambda k, final: _german_below_1000(k, final=final))
  return ''.join(parts) if compound else ' '.join(parts)


def _sample_number(rng: random.Random) -> int:
  """Draws a number whose digit count is uniform in 1..6.

  Uniform numbers would be 90% six-digit ones, and the model would rarely see the
  short numbers that teach it the basic words.
  """
  num_digits = rng.randint(1, 6)
  low = 0 if num_digits == 1 else 10**(num_digits - 1)
  return rng.randint(low, 10**num_digits - 1)


def _make_sentence_pair(n: int, rng: random.Random) -> tuple[str, str]:
  """Puts the number `n` into a random template, in both languages."""
  noun_templates = _NOUN_TEMPLATES if n != 1 else []  # "one apples" is wrong.
  en_template, de_template = rng.choice(noun_templates + _NUMBER_TEMPLATES)
  en_noun, de_noun = rng.choice(_NOUNS)
  english = en_template.format(n=number_to_english(n), noun=en_noun)
  german = de_template.format(n=number_to_german(n), noun=de_noun)
  return english, german


def _make_pairs(numbers: list[int], rng: random.Random) -> tuple[list[str], list[str]]:
  pairs = [_make_sentence_pair(n, rng) for n in numbers]
  return [en for en, _ in pairs], [de for _, de in pairs]


def make_numbers_corpus(num_examples: int, seed: int) -> tuple[list[str], list[str]]:
  """Returns `num_examples` (English, German) sentence lists; same seed, same corpus."""
  rng = random.Random(seed)
  numbers = [_sample_number(rng) for _ in range(num_examples)]
  return _make_pairs(numbers, rng)


def make_numbers_splits(seed: int = 0, train: int = 20_000, valid: int = 500,
                        test: int = 500) -> dict[str, tuple[list[str], list[str]]]:
  """Returns {'train', 'valid', 'test'} -> (English, German) with disjoint numbers.

  A number that appears in valid or test never appears in train, so the scores
  measure whether the model learned the rules rather than memorised sentences.
  Evaluation numbers are distinct and have at least three digits: the numbers
  0..99 are the vocabulary of the task (nobody can guess "dreizehn" from rules),
  so they stay in train.
  """
  if min(train, valid, test) < 0 or valid + test > _MAX_HELD_OUT:
    raise ConfigError(f'numbers splits need 0 <= valid + test <= {_MAX_HELD_OUT} and train >= 0, '
                      f'got train={train}, valid={valid}, test={test}')
  rng = random.Random(seed)
  held_out: list[int] = []
  seen: set[int] = set()
  while len(held_out) < valid + test:
    n = _sample_number(rng)
    if n >= 100 and n not in seen:
      seen.add(n)
      held_out.append(n)
  train_numbers = []
  while len(train_numbers) < train:
    n = _sample_number(rng)
    if n not in seen:
      train_numbers.append(n)
  return {
      'train': _make_pairs(train_numbers, rng),
      'valid': _make_pairs(held_out[:valid], rng),
      'test': _make_pairs(held_out[valid:], rng),
  }
