"""The families x uses table of docs/families.md, generated from the registry and the tests.

    python tools/families_table.py           # rewrites the table in docs/families.md
    python tools/families_table.py --check   # exit 1 if the file differs from what it would write

Columns are the families of the registry (transformer_jax/convert/families.py, in its order) and
the original Transformer, which has no Hugging Face class. Rows are the uses. A use applies to
some kinds of model (a causal LM, an encoder, an encoder-decoder); a cell of a kind it does not
apply to says why in the use's own line. An applicable cell names the test that runs it (TESTS),
or says 'untested': no test in the suite runs that use for that family (some are not built;
docs/families.md says which). tests/test_families_table.py checks that the file is what this
writes and that every test named here exists, so the table cannot drift from the suite.
"""

import argparse
import dataclasses
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

from transformer_jax.convert import families  # noqa: E402

DOC = os.path.join(REPO_ROOT, 'docs', 'families.md')
BEGIN = '<!-- families x uses: written by tools/families_table.py, do not edit by hand -->'
END = '<!-- end of families x uses -->'

# The original Transformer (Post-LN, sinusoidal positions): an encoder-decoder of this project
# with no Hugging Face family.
ORIGINAL, ORIGINAL_TITLE = 'transformer', 'Transformer (2017)'
CAUSAL, ENCODER, SEQ2SEQ = families.CAUSAL_LM, families.ENCODER, families.ENCODER_DECODER


@dataclasses.dataclass(frozen=True)
class Use:
  key: str
  title: str
  command: str
  kinds: tuple[str, ...]  # the kinds of model it applies to
  hf_only: bool = False  # it reads or writes a Hugging Face folder: not the original Transformer
  why_not: str = ''  # why the other cells do not apply


USES = (
    Use('train', 'train from scratch',
        '`experiments.lm` / `experiments.bert` / `experiments.translate --config=...`',
        (CAUSAL, ENCODER, SEQ2SEQ)),
    Use('import', 'import a Hugging Face folder', "`families.named(NAME).load(DIR)`",
        (CAUSAL, ENCODER, SEQ2SEQ), hf_only=True,
        why_not='the original Transformer has no Hugging Face class'),
    Use(
        'export', 'export', '`experiments.export --workdir=W --out=DIR`',
        (CAUSAL, ENCODER, SEQ2SEQ), hf_only=True,
        why_not='the original Transformer has no Hugging Face class: its export is one error '
        'line naming the switch'),
    Use('continue', 'continue pretraining from an import', '`--config.init.hf_dir=DIR`',
        (CAUSAL, ENCODER, SEQ2SEQ), hf_only=True,
        why_not='nothing to import for the original Transformer'),
    Use('classify', 'fine-tune: sentence classification',
        '`experiments.bert --config=experiments/configs/sst2_minilm.py --config.init.hf_dir=DIR`',
        (ENCODER,), why_not='an encoder use'),
    Use('pairs', 'fine-tune: sentence pairs',
        '`experiments.bert --config=experiments/configs/glue_pairs.py`', (ENCODER,),
        why_not='an encoder use'),
    Use('tagging', 'token tagging',
        '`experiments.bert --config=experiments/configs/conll_tagging.py`', (ENCODER,),
        why_not='an encoder use'),
    Use('fill_mask', 'fill-mask', '`experiments.bert --mode=fill_mask --hf_dir=DIR`', (ENCODER,),
        why_not='a masked-LM use'),
    Use('predict', 'predict / evaluate a classifier',
        '`experiments.bert --mode=predict` (or `evaluate`) `--workdir=W`', (ENCODER,),
        why_not='an encoder use'),
    Use('greedy', 'generate: greedy, against transformers',
        '`experiments.generate --hf_dir=DIR --temperature=0`', (CAUSAL,),
        why_not='a causal-LM use (encoder-decoders: translate / span fill)'),
    Use('beam', 'generate: beam search', '`experiments.generate ... --num_beams=4`', (CAUSAL,),
        why_not='a causal-LM use (encoder-decoders: translate / span fill)'),
    Use('batched', 'generate: sampled, prompts of any lengths in one batch',
        '`experiments.generate ... --prompts_file=F`', (CAUSAL,),
        why_not='a causal-LM use (encoder-decoders: translate / span fill)'),
    Use('streamed', 'generate: streamed', '`experiments.generate ... --prompt=P`', (CAUSAL,),
        why_not='a causal-LM use'),
    Use('perplexity', 'perplexity', '`experiments.lm --mode=evaluate --hf_dir=DIR --input=F`',
        (CAUSAL,), why_not='a causal-LM use'),
    Use('translate', 'translate / span fill', '`experiments.translate --mode=translate`',
        (SEQ2SEQ,), why_not='an encoder-decoder use'),
    Use('plan', 'plan for TPU and GPU', '`experiments.plan --config=... --target=...`',
        (CAUSAL, ENCODER, SEQ2SEQ)),
    Use('resume', 'elastic resume on another mesh', 'rerun on another device count',
        (CAUSAL, ENCODER, SEQ2SEQ)),
)

# (use, family) -> the test that runs it: 'tests/FILE.py::FUNCTION' or
# 'tests/FILE.py::FUNCTION[PARAM]' (PARAM: the case of a parametrized test or fixture).
TESTS = {
    ('train', 'gpt2'):
        'tests/test_hf_tokenizer.py::test_gpt2_shakespeare_bpe_trains',
    ('train', 'opt'):
        'tests/test_opt_train.py::'
        'test_opt_shakespeare_trains_from_the_command_line_and_exports_as_opt',
    ('train', 'llama'):
        'tests/test_llama_config.py::test_shrunk_config_trains_on_tiny_shakespeare',
    ('train', 't5'):
        'tests/test_corpus_t5.py::'
        'test_the_command_line_trains_from_the_shards_and_resumes_without_tokenizing',
    ('train', 'bert'):
        'tests/test_bert.py::test_pretraining_mlm_and_nsp_improve',
    ('train', 'roberta'):
        'tests/test_roberta_data.py::'
        'test_roberta_pretrain_small_lowers_mlm_loss_then_finetunes_from_hf',
    ('train', 'albert'):
        'tests/test_albert.py::test_pretraining_lowers_mlm_and_sop_loss',
    ('train', ORIGINAL):
        'tests/test_translate_cli.py::'
        'test_train_then_translate_stdin_then_evaluate_test_set',
    ('import', 'gpt2'):
        'tests/test_hf_gpt2_parity.py::test_logits_match_transformers',
    ('import', 'llama'):
        'tests/test_hf_llama_parity.py::test_logits_match_transformers',
    ('import', 'opt'):
        'tests/test_hf_opt_parity.py::test_logits_match_transformers',
    ('import', 't5'):
        'tests/test_hf_t5_parity.py::test_logits_match_transformers',
    ('import', 'bert'):
        'tests/test_hf_bert_parity.py::test_random_small_bert_matches_transformers',
    ('import', 'roberta'):
        'tests/test_hf_roberta_parity.py::test_masked_lm_matches_transformers',
    ('import', 'albert'):
        'tests/test_hf_albert_parity.py::'
        'test_pretraining_checkpoint_matches_and_round_trips',
    ('export', 'gpt2'):
        'tests/test_export.py::test_char_gpt2_workdir_loads_in_transformers',
    ('export', 'llama'):
        'tests/test_export.py::test_llama_workdir_loads_in_transformers',
    ('export', 'opt'):
        'tests/test_hf_opt_parity.py::'
        'test_export_loads_in_transformers_and_round_trips_bitwise',
    ('export', 't5'):
        'tests/test_export.py::test_t5_workdir_loads_in_transformers',
    ('export', 'bert'):
        'tests/test_export.py::test_pretraining_workdir_loads_in_transformers[bert]',
    ('export', 'roberta'):
        'tests/test_export.py::'
        'test_pretraining_workdir_loads_in_transformers[roberta]',
    ('export', 'albert'):
        'tests/test_export.py::'
        'test_pretraining_workdir_loads_in_transformers[albert]',
    ('classify', 'bert'):
        'tests/test_bert_predict.py::'
        'test_predict_probabilities_and_evaluate_scores',
    ('classify', 'roberta'):
        'tests/test_roberta_data.py::'
        'test_roberta_pretrain_small_lowers_mlm_loss_then_finetunes_from_hf',
    ('classify', 'albert'):
        'tests/test_hf_encoder_uses.py::'
        'test_albert_fine_tunes_from_an_hf_folder_and_predicts_from_its_workdir',
    ('continue', 'gpt2'):
        'tests/test_lm_continue_pretraining.py::'
        'test_continued_pretraining_starts_from_the_import_and_exports[gpt2]',
    ('continue', 'llama'):
        'tests/test_lm_continue_pretraining.py::'
        'test_continued_pretraining_starts_from_the_import_and_exports[llama]',
    ('continue', 'opt'):
        'tests/test_lm_continue_pretraining.py::'
        'test_continued_pretraining_starts_from_the_import_and_exports[opt]',
    ('continue', 'bert'):
        'tests/test_continue_pretraining.py::'
        'test_encoder_pretraining_continues_from_an_hf_folder[bert]',
    ('continue', 'albert'):
        'tests/test_continue_pretraining.py::'
        'test_encoder_pretraining_continues_from_an_hf_folder[albert]',
    ('continue', 'roberta'):
        'tests/test_continue_pretraining.py::'
        'test_encoder_pretraining_continues_from_an_hf_folder[roberta]',
    ('continue', 't5'):
        'tests/test_continue_pretraining.py::'
        'test_t5_span_corruption_continues_from_an_hf_folder',
    ('pairs', 'bert'):
        'tests/test_bert_pairs.py::test_pair_model_learns_sameness[bert]',
    ('pairs', 'roberta'):
        'tests/test_bert_pairs.py::test_pair_model_learns_sameness[roberta]',
    ('pairs', 'albert'):
        'tests/test_bert_pairs.py::test_pair_model_learns_sameness[albert]',
    ('tagging', 'bert'):
        'tests/test_token_classification.py::test_tagger_learns_number_words[bert]',
    ('tagging', 'roberta'):
        'tests/test_token_classification.py::test_tagger_learns_number_words[roberta]',
    ('tagging', 'albert'):
        'tests/test_token_classification.py::test_tagger_learns_number_words[albert]',
    ('fill_mask', 'bert'):
        'tests/test_bert_predict.py::test_fill_mask_matches_transformers_pipeline',
    ('fill_mask', 'roberta'):
        'tests/test_hf_encoder_uses.py::'
        'test_fill_mask_of_an_hf_folder_matches_transformers_pipeline[roberta]',
    ('fill_mask', 'albert'):
        'tests/test_hf_encoder_uses.py::'
        'test_fill_mask_of_an_hf_folder_matches_transformers_pipeline[albert]',
    ('predict', 'bert'):
        'tests/test_bert_predict.py::test_predict_probabilities_and_evaluate_scores',
    ('predict', 'roberta'):
        'tests/test_roberta_data.py::'
        'test_roberta_pretrain_small_lowers_mlm_loss_then_finetunes_from_hf',
    ('predict', 'albert'):
        'tests/test_hf_encoder_uses.py::'
        'test_albert_fine_tunes_from_an_hf_folder_and_predicts_from_its_workdir',
    ('greedy', 'gpt2'):
        'tests/test_generate_hf.py::'
        'test_greedy_continuation_matches_transformers_generate',
    ('greedy', 'llama'):
        'tests/test_hf_llama_parity.py::test_greedy_generation_matches_transformers',
    ('greedy', 'opt'):
        'tests/test_hf_opt_parity.py::test_greedy_generation_matches_transformers',
    ('beam', 'gpt2'):
        'tests/test_lm_beam_search.py::test_hypotheses_and_scores_match_transformers'
        '[gpt2]',
    ('beam', 'llama'):
        'tests/test_lm_beam_search.py::test_hypotheses_and_scores_match_transformers'
        '[llama]',
    ('beam', 'opt'):
        'tests/test_lm_beam_search.py::test_hypotheses_and_scores_match_transformers'
        '[opt]',
    ('batched', 'gpt2'):
        'tests/test_ragged_generation.py::'
        'test_sampling_with_a_key_per_row_gives_each_prompt_its_draws_alone[gpt2]',
    ('batched', 'llama'):
        'tests/test_ragged_generation.py::'
        'test_sampling_with_a_key_per_row_gives_each_prompt_its_draws_alone'
        '[llama]',
    # shakespeare_char.py's model is GPT-2's architecture (experiments/configs/lm_common.py).
    ('streamed', 'gpt2'):
        'tests/test_generate_stream.py::test_cli_stream_equals_one_shot[char]',
    ('streamed', 'llama'):
        'tests/test_generate_stream.py::test_cli_stream_equals_one_shot[llama]',
    ('streamed', 'opt'):
        'tests/test_generate_stream.py::test_cli_stream_equals_one_shot[opt]',
    ('batched', 'opt'):
        'tests/test_generate_stream.py::'
        'test_prompts_file_batch_equals_each_prompt_alone[opt]',
    ('perplexity', 'gpt2'):
        'tests/test_lm_evaluate.py::'
        'test_hf_bits_per_byte_matches_transformers_logits[gpt2]',
    ('perplexity', 'llama'):
        'tests/test_lm_evaluate.py::'
        'test_hf_bits_per_byte_matches_transformers_logits[llama]',
    ('perplexity', 'opt'):
        'tests/test_lm_evaluate.py::'
        'test_hf_bits_per_byte_matches_transformers_logits[opt]',
    ('translate', 't5'):
        'tests/test_t5_finetune.py::test_finetunes_a_hugging_face_t5',
    ('translate', ORIGINAL):
        'tests/test_translate_cli.py::'
        'test_train_then_translate_stdin_then_evaluate_test_set',
    ('plan', 'gpt2'):
        'tests/test_plan.py::test_every_family_compiles_under_each_mesh[lm]',
    ('plan', 'bert'):
        'tests/test_plan.py::test_every_family_compiles_under_each_mesh[bert]',
    ('plan', 'llama'):
        'tests/test_plan.py::test_every_family_compiles_under_each_mesh[llama]',
    ('plan', 'opt'):
        'tests/test_plan.py::test_every_family_compiles_under_each_mesh[opt]',
    ('plan', 't5'):
        'tests/test_plan.py::test_every_family_compiles_under_each_mesh[t5]',
    ('plan', 'roberta'):
        'tests/test_plan.py::test_every_family_compiles_under_each_mesh[roberta]',
    ('plan', 'albert'):
        'tests/test_plan.py::test_every_family_compiles_under_each_mesh[albert]',
    ('plan', ORIGINAL):
        'tests/test_plan.py::test_every_family_compiles_under_each_mesh[translation]',
    ('resume', 'gpt2'):
        'tests/test_elastic_resume.py::'
        'test_resume_on_other_meshes_continues_the_same_batches[gpt]',
    ('resume', 't5'):
        'tests/test_corpus_t5.py::test_eight_devices_fsdp_resumed_on_four',
    ('resume', 'llama'):
        'tests/test_elastic_resume.py::'
        'test_resume_on_other_meshes_continues_the_same_batches[llama]',
    ('resume', 'opt'):
        'tests/test_elastic_resume.py::'
        'test_resume_on_other_meshes_continues_the_same_batches[opt]',
    ('resume', 'roberta'):
        'tests/test_elastic_resume.py::'
        'test_resume_on_other_meshes_continues_the_same_batches[roberta]',
    ('resume', 'albert'):
        'tests/test_elastic_resume.py::'
        'test_resume_on_other_meshes_continues_the_same_batches[albert]',
    ('resume', 'bert'):
        'tests/test_elastic_resume.py::'
        'test_resume_on_other_meshes_continues_the_same_batches[bert]',
    ('resume', ORIGINAL):
        'tests/test_elastic_resume.py::'
        'test_resume_on_other_meshes_continues_the_same_batches[translation]',
}

# Applicable cells that are not built at all (rather than built and untested), with the reason.
NOT_BUILT: dict[tuple[str, str], str] = {}


def columns() -> list[tuple[str, str, str]]:
  """(name, title, kind) of each column: the registry's families, then the original Transformer."""
  return [(f.name, f.title or f.name, f.kind) for f in families.FAMILIES
         ] + [(ORIGINAL, ORIGINAL_TITLE, SEQ2SEQ)]


def applies(use: Use, name: str, kind: str) -> bool:
  return kind in use.kinds and not (use.hf_only and name == ORIGINAL)


def cells() -> dict[tuple[str, str], str]:
  """(use, family) -> 'test' | 'not built' | 'untested' | 'n/a' for every cell."""
  out = {}
  for use in USES:
    for name, _, kind in columns():
      if not applies(use, name, kind):
        out[use.key, name] = 'n/a'
      elif (use.key, name) in TESTS:
        out[use.key, name] = 'test'
      elif (use.key, name) in NOT_BUILT:
        out[use.key, name] = 'not built'
      else:
        out[use.key, name] = 'untested'
  return out


def render() -> str:
  """The markdown between BEGIN and END (those lines included)."""
  cols = columns()
  status = cells()
  numbers = {}  # test reference -> its number in the list under the table
  lines = [
      BEGIN, '', '| use | command | ' + ' | '.join(title for _, title, _ in cols) + ' |',
      '|---|---|' + '---|' * len(cols)
  ]
  for use in USES:
    row = []
    for name, _, _ in cols:
      state = status[use.key, name]
      if state == 'test':
        reference = TESTS[use.key, name]
        number = numbers.setdefault(reference, len(numbers) + 1)
        row.append(f'[{number}](#t{number})')
      else:
        row.append({'n/a': '—', 'not built': 'not built', 'untested': '**untested**'}[state])
    lines.append(f'| {use.title} | {use.command} | ' + ' | '.join(row) + ' |')
  tested = sum(state == 'test' for state in status.values())
  untested = sum(state == 'untested' for state in status.values())
  applicable = sum(state != 'n/a' for state in status.values())
  not_built = applicable - tested - untested
  are = lambda n: f'{n} is' if n == 1 else f'{n} are'
  lines += [
      '', f'{tested} of the {applicable} cells that apply run in the suite; {are(untested)} '
      f'untested (no test runs them; they may not work) and {are(not_built)} not built. A dash: '
      'the use does not apply:', ''
  ]
  lines += [f'- {use.title}: {use.why_not}.' for use in USES if use.why_not]
  lines += [f'- not built, {use}, {name}: {why}.' for (use, name), why in NOT_BUILT.items()]
  lines += ['', 'The tests:', '']
  lines += [f'{n}. <a id="t{n}"></a>`{reference}`' for reference, n in numbers.items()]
  lines += ['', END]
  return '\n'.join(lines)


def rewritten(text: str) -> str:
  """`text` (docs/families.md) with its table replaced by `render()`; ValueError without the
  markers."""
  start, end = text.find(BEGIN), text.find(END)
  if start < 0 or end < start:
    raise ValueError(f'{DOC} lacks the lines {BEGIN!r} ... {END!r}')
  return text[:start] + render() + text[end + len(END):]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--check', action='store_true',
                      help='exit 1 if docs/families.md differs from what would be written')
  args = parser.parse_args()
  with open(DOC, encoding='utf-8') as f:
    text = f.read()
  new = rewritten(text)
  if args.check:
    if new != text:
      print(f'error: {DOC} is not what tools/families_table.py writes; run it', file=sys.stderr)
      return 1
    return 0
  if new != text:
    with open(DOC, 'w', encoding='utf-8') as f:
      f.write(new)
  print(f'{DOC}: {sum(s == "test" for s in cells().values())} cells with a test')
  return 0


if __name__ == '__main__':
  sys.exit(main())
