"""Reading plain-text corpora: one sentence per line, optionally gzip-compressed.

Parallel corpora are two files whose line i are translations of each other, so
everything here is careful to keep the two sides aligned: a line is never
dropped from one side without dropping its partner from the other.
"""

import gzip
import os
import zlib
from typing import BinaryIO

from absl import logging

from transformer_jax.errors import DataError

_SKIP_OPTION = 'skip_invalid_utf8'


def _open_binary(path: str) -> BinaryIO:
  """Opens `path` for reading bytes, decompressing `.gz` files on the fly."""
  if not os.path.isfile(path):
    raise DataError(f'data file {path} does not exist; check the path and the data directory')
  if path.endswith('.gz'):
    return gzip.open(path, 'rb')
  return open(path, 'rb')


def _decode_lines(path: str, *, skip_invalid_utf8: bool) -> list[str | None]:
  """Returns every line of `path`, stripped; None marks a skipped invalid line.

  Keeping a placeholder (instead of dropping the line here) lets `read_parallel`
  drop the partner line on the other side and so keep the corpus aligned.
  """
  lines: list[str | None] = []
  try:
    with _open_binary(path) as f:
      # Iterating over bytes splits on b'\n' only. Decoding first and then splitting
      # would also split on Unicode separators such as U+2028, which can occur inside a
      # sentence and would shift every following line out of alignment.
      for line_number, raw in enumerate(f, start=1):
        try:
          line = raw.decode('utf-8')
        except UnicodeDecodeError as e:
          if skip_invalid_utf8:
            lines.append(None)
            continue
          raise DataError(f'{path}:{line_number}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at byte '
                          f'{e.start + 1} of the line); fix the file or set {_SKIP_OPTION}=True to '
                          'drop such lines') from None
        if line_number == 1:
          # A UTF-8 byte order mark is not whitespace, so strip() would keep it and it
          # would become part of the first sentence.
          line = line.removeprefix('\ufeff')
        lines.append(line.strip())
  except (gzip.BadGzipFile, EOFError, zlib.error) as e:
    raise DataError(f'{path} is not a valid gzip file ({e}); re-download it or remove the '
                    '.gz suffix if it is plain text') from None
  except OSError as e:
    raise DataError(f'cannot read {path}: {e.strerror or e}') from None
  return lines


def read_lines_with_stats(path: str, *, skip_invalid_utf8: bool = False) -> tuple[list[str], int]:
  """Reads one sentence per line; returns (lines, number of invalid lines skipped)."""
  lines = _decode_lines(path, skip_invalid_utf8=skip_invalid_utf8)
  kept = [line for line in lines if line is not None]
  return kept, len(lines) - len(kept)


def read_lines(path: str, *, skip_invalid_utf8: bool = False) -> list[str]:
  """Reads a `.gz` or plain UTF-8 text file, one stripped sentence per line.

  Empty lines are kept so that line numbers still match the file. With
  `skip_invalid_utf8`, lines that are not valid UTF-8 are dropped (and logged)
  instead of raising a `DataError`.
  """
  lines, num_skipped = read_lines_with_stats(path, skip_invalid_utf8=skip_invalid_utf8)
  if num_skipped:
    logging.warning('%s: skipped %d lines with invalid UTF-8', path, num_skipped)
  return lines


def find_parallel_files(data_dir: str, split: str, src_lang: str, tgt_lang: str) -> tuple[str, str]:
  """Returns the (source, target) paths `{data_dir}/{split}.{lang}[.gz]`.

  The gzip file wins when both exist because corpora are usually shipped compressed
  and an uncompressed copy is more likely to be a stale by-product.
  """
  if not os.path.isdir(data_dir):
    raise DataError(f'data directory {data_dir} does not exist; set the data directory to '
                    'the folder that holds the corpus files')
  paths = []
  for lang in (src_lang, tgt_lang):
    candidates = [os.path.join(data_dir, f'{split}.{lang}{suffix}') for suffix in ('.gz', '')]
    found = [path for path in candidates if os.path.isfile(path)]
    if not found:
      available = sorted(name for name in os.listdir(data_dir) if not name.startswith('.'))
      shown = ', '.join(available[:20]) + (', ...' if len(available) > 20 else '')
      raise DataError(f'no {lang!r} file for split {split!r}: looked for '
                      f'{" and ".join(candidates)}; {data_dir} contains: {shown or "nothing"}')
    paths.append(found[0])
  return paths[0], paths[1]


def read_parallel(src_path: str, tgt_path: str, *,
                  skip_invalid_utf8: bool = False) -> tuple[list[str], list[str]]:
  """Reads an aligned pair of files and returns the non-empty sentence pairs.

  A pair is dropped (and the count logged) when either side is empty, or, with
  `skip_invalid_utf8`, when either side is not valid UTF-8.
  """
  src = _decode_lines(src_path, skip_invalid_utf8=skip_invalid_utf8)
  tgt = _decode_lines(tgt_path, skip_invalid_utf8=skip_invalid_utf8)
  if len(src) != len(tgt):
    raise DataError(f'parallel files have different line counts: {src_path} has {len(src)} '
                    f'lines but {tgt_path} has {len(tgt)}; line i of each file must be '
                    'translations of each other')
  if not src:
    raise DataError(f'parallel corpus {src_path} / {tgt_path} is empty (0 lines)')

  src_kept, tgt_kept = [], []
  num_invalid = num_empty = 0
  for s, t in zip(src, tgt):
    if s is None or t is None:
      num_invalid += 1
    elif not s or not t:
      num_empty += 1
    else:
      src_kept.append(s)
      tgt_kept.append(t)
  if num_invalid:
    logging.warning('%s / %s: dropped %d pairs with invalid UTF-8 on either side', src_path,
                    tgt_path, num_invalid)
  if num_empty:
    logging.info('%s / %s: dropped %d pairs with an empty side', src_path, tgt_path, num_empty)
  if not src_kept:
    raise DataError(f'parallel corpus {src_path} / {tgt_path} has no pair with text on both '
                    f'sides ({len(src)} lines: {num_empty} with an empty side, {num_invalid} '
                    'with invalid UTF-8)')
  logging.info('read %d sentence pairs from %s / %s', len(src_kept), src_path, tgt_path)
  return src_kept, tgt_kept
