r"""Tokenize a corpus once into token shards, for pretraining on corpora of any size.

  # 2 GB of text files into shards, a byte-level BPE of 32k trained on a 64 MB sample,
  # 0.05% of the documents held out for validation, a worker per core
  python -m experiments.prepare --sources='corpus/*.txt' --output=/data/owt \
      --tokenizer=byte_bpe --vocab_size=32768 --valid_fraction=0.0005
  # JSON Lines or Parquet with a text field; a TFDS corpus and its validation split
  python -m experiments.prepare --sources=wiki.jsonl.gz --text_field=text ...
  python -m experiments.prepare --sources=tfds:lm1b --tfds_valid_split=test \
      --tokenizer=sentencepiece --vocab_size=32000 --output=gs://bucket/lm1b
  # BERT and T5 read sentence lines: --unit=lines; a tokenizer from a workdir or HF folder
  python -m experiments.prepare --sources=books/ --unit=lines --tokenizer=wordpiece ...
  # on a Ray cluster (pip install -e ".[ray]"); the bytes equal the local engine's
  python -m experiments.prepare ... --engine=ray --ray_address=auto

Rerun the same command after a kill: finished shards are kept. Train from the folder with
`--config.data.source=prepared --config.data.prepared=DIR` (docs/data.md). The last line of
output is one JSON object: shards, tokens, seconds.
"""

import json
import time

from absl import app, flags

from transformer_jax.cli import entrypoint
from transformer_jax.corpus import engines, prepare, shards, sources, tokenizers
from transformer_jax.errors import ConfigError

_SOURCES = flags.DEFINE_list(
    'sources', [], 'Text files (.gz too), globs, folders, JSON Lines, '
    'Parquet files, or tfds:NAME.')
_OUTPUT = flags.DEFINE_string('output', None, 'Folder of the prepared corpus (local or gs://...).')
_TOKENIZER = flags.DEFINE_enum('tokenizer', None, list(tokenizers.KINDS), 'Tokenizer kind.')
_VOCAB = flags.DEFINE_integer('vocab_size', 8192, 'Vocabulary of a tokenizer trained here.')
_FROM = flags.DEFINE_string(
    'tokenizer_from', '', 'Take the tokenizer from this workdir, file or '
    'Hugging Face folder instead of training one.')
_SAMPLE = flags.DEFINE_integer('tokenizer_sample_mb', 64,
                               'MB of text (spread over the units) to train the tokenizer on.')
_LOWERCASE = flags.DEFINE_bool('lowercase', True, 'WordPiece: lowercase the text.')
_MODEL_TYPE = flags.DEFINE_string('model_type', 'unigram', 'SentencePiece model type.')
_UNIT = flags.DEFINE_enum('unit', 'documents', list(shards.UNITS),
                          "'documents' (language models: ids + EOS) or 'lines' (BERT, T5).")
_DOCUMENTS = flags.DEFINE_enum('documents', 'blank_lines', list(sources.DOCUMENT_MODES),
                               'How text files separate documents.')
_FIELD = flags.DEFINE_string('text_field', 'text', 'JSON Lines / Parquet / TFDS text field.')
_INVALID = flags.DEFINE_enum('invalid_utf8', 'skip', list(sources.INVALID_UTF8),
                             'Lines that are not UTF-8: skip (counted) or error.')
_VALID_FRACTION = flags.DEFINE_float('valid_fraction', 0.0,
                                     'Hold out this fraction of the documents (seeded draw).')
_VALID_SOURCES = flags.DEFINE_list('valid_sources', [], 'Validation sources instead.')
_TRAIN_FRACTION = flags.DEFINE_float(
    'train_fraction', 0.0, 'One plain file: its first fraction '
    'trains, the rest validates (contiguous).')
_TFDS_SPLIT = flags.DEFINE_string('tfds_split', 'train', 'TFDS training split.')
_TFDS_VALID = flags.DEFINE_string('tfds_valid_split', '', 'TFDS validation split.')
_TFDS_DIR = flags.DEFINE_string('tfds_data_dir', '', 'TFDS data_dir.')
_MAX_EXAMPLES = flags.DEFINE_integer('max_examples', 0, 'TFDS: examples per split (0: all).')
_UNIT_MB = flags.DEFINE_integer('unit_mb', 64, 'MB of input per shard (files are cut there).')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the validation draw.')
_DTYPE = flags.DEFINE_string('dtype', '', 'uint16 or uint32 (default: by vocabulary size).')
_WORKERS = flags.DEFINE_integer('workers', 0, 'Worker processes (default: the usable cores).')
_ENGINE = flags.DEFINE_enum('engine', 'local', list(engines.ENGINES), 'Where units run.')
_RAY = flags.DEFINE_string('ray_address', '', 'Ray cluster address (default: start a local one).')


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  if not _OUTPUT.value or not _TOKENIZER.value:
    raise ConfigError('pass --output=DIR and --tokenizer=KIND (and --sources=...)')
  options = prepare.Options(sources=tuple(_SOURCES.value), tokenizer=_TOKENIZER.value,
                            unit=_UNIT.value, vocab_size=_VOCAB.value, tokenizer_from=_FROM.value,
                            tokenizer_sample_bytes=_SAMPLE.value << 20, lowercase=_LOWERCASE.value,
                            model_type=_MODEL_TYPE.value, documents=_DOCUMENTS.value,
                            text_field=_FIELD.value, invalid_utf8=_INVALID.value,
                            valid_fraction=_VALID_FRACTION.value, valid_sources=tuple(
                                _VALID_SOURCES.value), train_fraction=_TRAIN_FRACTION.value,
                            tfds_split=_TFDS_SPLIT.value, tfds_valid_split=_TFDS_VALID.value,
                            tfds_data_dir=_TFDS_DIR.value, max_examples=_MAX_EXAMPLES.value,
                            unit_bytes=_UNIT_MB.value << 20, seed=_SEED.value, dtype=_DTYPE.value)
  start = time.time()
  manifest = prepare.prepare(options, _OUTPUT.value, engine=_ENGINE.value, workers=_WORKERS.value,
                             ray_address=_RAY.value)
  splits = manifest['splits']
  print(
      json.dumps({
          'output': _OUTPUT.value, 'train_tokens': splits['train']['tokens'],
          'valid_tokens': splits['valid']['tokens'], 'train_documents': splits['train']
                                                                        ['documents'],
          'shards': len(splits['train']['shards']) + len(splits['valid']['shards']),
          'tokenizer': manifest['tokenizer'], 'seconds': round(time.time() - start, 2)
      }))


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv, uses_jax=False))
