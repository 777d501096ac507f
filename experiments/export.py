r"""Export a trained workdir as a Hugging Face model directory (transformers loads it as it is).

  python -m experiments.export --workdir=/tmp/sc --out=/tmp/sc_hf
  # then, in PyTorch: AutoModelForCausalLM.from_pretrained('/tmp/sc_hf'),
  #                   AutoTokenizer.from_pretrained('/tmp/sc_hf')

The family follows from the workdir's config (transformer_jax/workflows/export.py): a GPT-2-style
language model -> gpt2, one with OPT's switches (GPT-2's with ReLU) -> opt, a LLaMA-style one ->
llama, a BERT -> bert, an ALBERT -> albert, a RoBERTa (byte-level BPE) -> roberta, a T5-style
translation model -> t5. Prints the output directory and the family on stdout (logs go to
stderr). --out must not exist or be empty; a model no Hugging Face class computes, a workdir
without a checkpoint or an existing --out is one error line and exit status 1, with nothing
written.
"""

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

import sys

from absl import app, flags

from transformer_jax.cli import entrypoint
from transformer_jax.errors import ConfigError

_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'A workdir trained by experiments.lm, experiments.bert or '
    'experiments.translate.')
_OUT = flags.DEFINE_string('out', None, 'The new directory to write the Hugging Face model to.')


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  from transformer_jax.convert.export import check_out_dir
  from transformer_jax.workflows.export import export_workdir
  out_dir = check_out_dir(_OUT.value or '')
  family = export_workdir(_WORKDIR.value or '', out_dir)
  sys.stdout.write(f'{out_dir} {family}\n')
  sys.stdout.flush()


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
