"""Elastic resume: a run checkpointed on one layout continues on another with the same batches.

The slow tests run the real command lines on simulated CPU devices (the device count is fixed
when jax starts, so each run is its own process). A reference trains 6 steps uninterrupted on 8
devices (mesh data=8); a copy of its workdir is taken back to its step-3 checkpoint, as a run
killed there would leave it, and resumed on 4 devices (data=2 x fsdp=2), on 2 and on 1; a run of
3 steps on fsdp=8 is resumed on data=8. Every resumed step must train on the reference's global
batch (the SHA-256 of every array the devices receive, train.record_batches) and reach its loss
within LOSS_RTOL: the state restores bitwise, but XLA reduces in another order on another mesh
(measured: at most ~2e-7 relative over three steps, float32), so the losses are not bitwise.
GPT (random windows), BERT (masked LM + NSP, dropout on in both) and packed translation; LLaMA,
OPT, RoBERTa (full sentences) and ALBERT (sentence order) resume once, on data=2 x fsdp=2.

The fast tests check the pieces: the layout and its checks (training/elastic.py), the 'run'
item of a checkpoint and checkpoints written before it, orbax's retention, the batch digest,
and that every batcher's saved position is one of the global stream, the same whatever the
process count.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT
from transformer_jax import xla_options
from transformer_jax.errors import ConfigError
from transformer_jax.training import batch_record, elastic

LOSS_RTOL = 1e-5

TINY = {
    'model.emb_dim': 32,
    'model.num_heads': 2,
    'model.mlp_dim': 64,
    'model.dropout_rate': 0.1,
    'optimizer.warmup_steps': 2,
    'train.log_every': 1,
    'train.eval_every': 0,
    'train.checkpoint_every': 3,
    'train.keep_checkpoints': 5,
    'train.record_batches': True,
}
# 480 // 32 = 15 packed rows: 8 rounded to 8 devices, but 12, 14, 15 on 4, 2, 1; the resumes keep
# 8 (the first layout's), or their batches would differ from the reference's.
PACKED_BATCH_TOKENS = 480
_GPT = {
    'model.num_decoder_layers': 2,
    'model.attention_dropout_rate': 0.1,
    'data.block_size': 16,
    'data.batch_size': 8,
    'data.eval_batches': 1,
    'eval.sample_tokens': 0,
}
_BERT = {
    'model.num_encoder_layers': 1,
    'model.max_len': 32,
    'data.lines_per_document': 0,
    'data.valid_fraction': 0.1,
    'data.max_len': 32,
    'data.max_predictions': 5,
    'data.batch_size': 8,
    'data.eval_batches': 1,
    'tokenizer.vocab_size': 100,
}
FAMILIES = {
    'gpt': ('experiments.lm', 'experiments/configs/shakespeare_char.py', _GPT),
    'bert': ('experiments.bert', 'experiments/configs/bert_pretrain_small.py', _BERT),
    'translation': ('experiments.translate', 'experiments/configs/translate_quickstart.py', {
        'model.num_encoder_layers': 1,
        'model.num_decoder_layers': 1,
        'model.attention_dropout_rate': 0.1,
        'data.pack': True,
        'data.max_len': 32,
        'data.batch_tokens': PACKED_BATCH_TOKENS,
        'data.max_train_examples': 300,
        'train.eval_max_batches': 1,
        'eval.bleu_sentences': 2,
        'eval.decode_rows': 64,
        'eval.test_prefix': '',
    }),
    # The other families, through the batchers above: LLaMA (4 query heads on its config's 2
    # key/value heads), OPT (GPT-2's switches with ReLU: convert/hf_opt.py), RoBERTa (full
    # sentences, a byte-level BPE) and ALBERT (sentence order, a factorised embedding, one layer
    # applied twice).
    'llama': ('experiments.lm', 'experiments/configs/llama_shakespeare.py',
              {**_GPT, 'model.num_heads': 4}),
    'opt': ('experiments.lm', 'experiments/configs/shakespeare_char.py',
            {**_GPT, 'model.activation': 'relu'}),
    'roberta': ('experiments.bert', 'experiments/configs/roberta_pretrain_small.py',
                {**_BERT, 'tokenizer.vocab_size': 300}),
    'albert': ('experiments.bert', 'experiments/configs/albert_pretrain_small.py',
               {**_BERT, 'model.embedding_size': 16, 'model.num_encoder_layers': 2}),
}
# Each workflow's batcher resumes on every layout below; the families that reuse one resume
# once, on data2_fsdp2: another device count, and state split where the reference's was whole.
WORKFLOW_FAMILIES = ('gpt', 'bert', 'translation')
# Where each resume runs: (devices, mesh flags).
RESUMES = {
    'data2_fsdp2': (4, {'mesh.data': 2, 'mesh.fsdp': 2}),
    'two': (2, {}),
    'one': (1, {}),
}


def bert_text(folder) -> str:
  """A small corpus of 40 five-line documents (the BERT tokenizer trains on it in a second)."""
  words = 'the cat sat on a mat while dogs ran in the park and birds sang songs'.split()
  rng = np.random.RandomState(0)
  docs = ['\n'.join(' '.join(rng.choice(words, 8)) for _ in range(5)) for _ in range(40)]
  path = folder / 'text.txt'
  path.write_text('\n\n'.join(docs) + '\n')
  return str(path)


def run(translate_cli, family: str, data: str, workdir, steps: int, devices: int,
        flags: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
  """`python -m experiments.X` of `family` for `steps` steps on `devices` simulated devices."""
  module, config, values = FAMILIES[family]
  values = {**TINY, **values, 'train.num_steps': steps, **(flags or {})}
  if data:  # translation reads Multi30k, as the quickstart config says
    values['data.paths' if module == 'experiments.bert' else 'data.path'] = data
  command = [sys.executable, '-m', module, f'--config={config}', f'--workdir={workdir}']
  command += [f'--config.{k}={v}' for k, v in values.items()]
  env = xla_options.host_devices_env(devices, translate_cli.env())
  proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=600, check=False)
  if check:
    assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


def losses(workdir) -> dict[int, float]:
  """{step: train loss} of metrics.jsonl, the last record of each step."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return {r['step']: r['train/loss'] for r in records if 'train/loss' in r}


def provenance(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'provenance.jsonl')) as f:
    return [json.loads(line) for line in f]


# What a run writes about itself; the rest of a workdir's top-level files are its tokenizer's.
RUN_RECORDS = ('config.json', 'metrics.jsonl', 'provenance.jsonl', batch_record.FILE_NAME)


def rewind(source, target, step: int):
  """A copy of workdir `source` as a run killed right after its checkpoint at `step` leaves it:
  later checkpoints gone, the per-step logs cut after `step`."""
  shutil.copytree(source, target)
  for name in os.listdir(target / 'checkpoints'):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(target / 'checkpoints' / name)
  for log in ('metrics.jsonl', batch_record.FILE_NAME):
    with open(target / log) as f:
      kept = [line for line in f if json.loads(line)['step'] <= step]
    (target / log).write_text(''.join(kept))


def family_data(family: str, tiny_shakespeare: str, tmp_path) -> str:
  """The text a family trains on ('' = its config's own)."""
  module = FAMILIES[family][0]
  if module == 'experiments.bert':
    return bert_text(tmp_path)
  return tiny_shakespeare if module == 'experiments.lm' else ''


def check_resumed_like_reference(reference, resumed, name: str) -> float:
  """Asserts steps 4-6 of `resumed` trained on the reference's batches to its losses; returns
  the largest relative loss difference."""
  want, got = batch_record.read(reference), batch_record.read(resumed)
  assert sorted(want) == sorted(got) == [1, 2, 3, 4, 5, 6], name
  assert got == want, f'{name}: other global batches than the uninterrupted run'
  ref_loss, new_loss = losses(reference), losses(resumed)
  steps = [4, 5, 6]
  np.testing.assert_allclose([new_loss[s] for s in steps], [ref_loss[s] for s in steps],
                             rtol=LOSS_RTOL, err_msg=name)
  return max(abs(new_loss[s] - ref_loss[s]) / abs(ref_loss[s]) for s in steps)


@pytest.mark.slow
@pytest.mark.parametrize('family', list(FAMILIES))
def test_resume_on_other_meshes_continues_the_same_batches(family, translate_cli, tiny_shakespeare,
                                                           tmp_path, capsys):
  data = family_data(family, tiny_shakespeare, tmp_path)
  reference = tmp_path / 'reference'
  run(translate_cli, family, data, reference, steps=6, devices=8)
  differences = {}
  resumes = RESUMES if family in WORKFLOW_FAMILIES else {'data2_fsdp2': RESUMES['data2_fsdp2']}
  for name, (devices, mesh) in resumes.items():
    resumed = tmp_path / name
    rewind(reference, resumed, 3)
    proc = run(translate_cli, family, data, resumed, steps=6, devices=devices, flags=mesh)
    assert 'resuming the run saved at step 3 on 8 devices' in proc.stderr
    differences[name] = check_resumed_like_reference(reference, resumed, name)
    start = provenance(resumed)[-1]
    assert start['start_step'] == 3
    assert start['resumed_from']['devices'] == 8 and start['layout']['devices'] == devices
    assert start['resumed_from']['mesh']['data'] == 8
    assert start['layout']['batch_multiple'] == 8  # the first layout's, kept
  if family in WORKFLOW_FAMILIES:
    differences['fsdp8_to_data8'] = fsdp8_resumed_on_data8(translate_cli, family, data, reference,
                                                           tmp_path / 'fsdp8')
  with capsys.disabled():  # the figures the docs quote
    print(f'\n{family}: largest relative loss difference after resume: ' +
          ', '.join(f'{k} {v:.1e}' for k, v in differences.items()))


def fsdp8_resumed_on_data8(translate_cli, family: str, data: str, reference, fsdp) -> float:
  """3 steps on fsdp=8 (params and optimizer state split 8 ways) resumed on data=8 (replicated),
  checked against `reference`. A fresh run, given the reference's tokenizer files: what is
  compared here is the state on another mesh, not whether a tokenizer trained again comes out
  the same (tests/test_bert_data.py)."""
  fsdp.mkdir()
  for name in os.listdir(reference):
    if name not in RUN_RECORDS and os.path.isfile(reference / name):
      shutil.copy(reference / name, fsdp / name)
  run(translate_cli, family, data, fsdp, steps=3, devices=8, flags={'mesh.data': 1, 'mesh.fsdp': 8})
  run(translate_cli, family, data, fsdp, steps=6, devices=8)
  assert provenance(fsdp)[-1]['resumed_from']['mesh'] == {'data': 1, 'fsdp': 8, 'tensor': 1}
  return check_resumed_like_reference(reference, fsdp, 'fsdp8')


def snapshot(folder) -> dict[str, str]:
  """{relative path: sha256} of every file under `folder`."""
  out = {}
  for root, _, files in os.walk(folder):
    for name in files:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.mark.slow
def test_a_mesh_that_cannot_split_the_global_batch_is_one_error_and_writes_nothing(
    translate_cli, tmp_path):
  """Length-bucketed batches of 15 rows (batch_tokens 480 // 32, first run on one device)
  cannot be split over 2 devices: one error line naming what to change, exit 1, the workdir
  as it was."""
  workdir = tmp_path / 'run'
  flags = {'data.pack': False, 'data.buckets': (32,), 'data.batch_tokens': 480}
  run(translate_cli, 'translation', '', workdir, steps=1, devices=1, flags=flags)
  before = snapshot(workdir)
  proc = run(translate_cli, 'translation', '', workdir, steps=2, devices=2, flags=flags,
             check=False)
  assert proc.returncode == 1, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1, proc.stderr[-3000:]
  assert 'global batches of 15 rows' in errors[0] and 'kept from the run saved on 1 device' in (
      errors[0])
  assert 'mesh.data x mesh.fsdp' in errors[0] and 'data.batch_tokens' in errors[0]
  assert 'Traceback' not in proc.stderr
  assert snapshot(workdir) == before


@pytest.mark.slow
def test_elastic_accumulation_keeps_the_device_batch_and_the_update(translate_cli, tiny_shakespeare,
                                                                    tmp_path):
  """8 devices -> 2 with train.elastic_accumulation: 4 accumulation steps of the same global
  batch; without dropout the update is the same one, so the losses match."""
  no_dropout = {'model.dropout_rate': 0.0, 'model.attention_dropout_rate': 0.0}
  reference = tmp_path / 'reference'
  run(translate_cli, 'gpt', tiny_shakespeare, reference, steps=6, devices=8, flags=no_dropout)
  resumed = tmp_path / 'resumed'
  rewind(reference, resumed, 3)
  run(translate_cli, 'gpt', tiny_shakespeare, resumed, steps=6, devices=2,
      flags={**no_dropout, 'train.elastic_accumulation': True})
  layout = provenance(resumed)[-1]['layout']
  assert layout['accumulation_steps'] == 4 and layout['devices'] == 2
  check_resumed_like_reference(reference, resumed, 'elastic accumulation')


# -- the pieces -----------------------------------------------------------------------------------


def layout(devices=8, data=8, fsdp=1, accumulation=1, multiple=8, processes=1):
  return elastic.Layout(devices=devices, processes=processes,
                        mesh={'data': data, 'fsdp': fsdp, 'tensor': 1},
                        accumulation_steps=accumulation, batch_multiple=multiple)


class FakeMesh:
  """What elastic.py reads of a mesh: its axis sizes and device count."""

  def __init__(self, data, fsdp=1):
    self.shape = {'data': data, 'fsdp': fsdp, 'tensor': 1}
    self.size = data * fsdp


def test_layout_round_trips_and_describes_itself():
  saved = layout(data=2, fsdp=2, devices=4, accumulation=2, multiple=8, processes=2)
  assert elastic.Layout.from_json(saved.to_json(), 'here') == saved
  assert saved.ways == 4
  assert saved.describe() == '4 devices in 2 processes, mesh data=2 x fsdp=2, 2 accumulation steps'
  with pytest.raises(ConfigError, match='the run layout saved in /ckpt is malformed'):
    elastic.Layout.from_json({'devices': 8}, '/ckpt')


def test_elastic_accumulation_steps():
  saved = layout()  # 8 data-parallel devices, 1 step
  assert elastic.accumulation_steps(saved, FakeMesh(2), 1, elastic=True) == 4
  assert elastic.accumulation_steps(saved, FakeMesh(2, 2), 1, elastic=True) == 2
  assert elastic.accumulation_steps(saved, FakeMesh(2), 1, elastic=False) == 1
  assert elastic.accumulation_steps(None, FakeMesh(2), 3, elastic=True) == 3  # a fresh run
  assert elastic.accumulation_steps(layout(data=2, devices=2, accumulation=4), FakeMesh(8), 4,
                                    elastic=True) == 1
  with pytest.raises(ConfigError, match='do not split over data x fsdp = 16 devices'):
    elastic.accumulation_steps(saved, FakeMesh(16), 1, elastic=True)


def test_check_rows_names_what_to_change():
  saved = layout(devices=1, data=1, multiple=1)
  now = elastic.Layout(devices=2, processes=1, mesh={'data': 2, 'fsdp': 1, 'tensor': 1},
                       accumulation_steps=1, batch_multiple=1)
  elastic.check_rows([16, 8, 4], now, saved)
  with pytest.raises(ConfigError) as error:
    elastic.check_rows([16, 15, 4], now, saved)
  message = str(error.value)
  assert 'global batches of 15 rows (kept from the run saved on 1 device in 1 process' in message
  assert 'divides 1' in message and 'train.elastic_accumulation=True' in message


def test_fresh_layout_takes_this_mesh_and_a_resume_keeps_the_first(monkeypatch):
  fresh = elastic.current(FakeMesh(2, 2), 2, None)
  assert (fresh.devices, fresh.batch_multiple, fresh.accumulation_steps) == (4, 8, 2)
  resumed = elastic.current(FakeMesh(1), 1, layout(multiple=8))
  assert (resumed.devices, resumed.batch_multiple) == (1, 8)


def small_state(value: float):
  import jax.numpy as jnp
  return {'w': jnp.full((4,), value, jnp.float32)}


def test_checkpoints_keep_the_run_layout_and_older_ones_restore_without_it(tmp_path):
  import jax
  from transformer_jax.training.checkpointing import Checkpointer, abstract_like
  checkpointer = Checkpointer(str(tmp_path / 'ckpt'), keep=2, save_every=1)
  checkpointer.maybe_save(1, small_state(1.0), {'step': 1})  # as before the layout existed
  checkpointer.wait()
  assert checkpointer.run_layout() is None
  saved = layout(devices=2, data=2, multiple=2)
  for step in (2, 3):
    checkpointer.maybe_save(step, small_state(step), {'step': step}, saved.to_json())
  checkpointer.wait()
  assert checkpointer.run_layout() == (3, saved.to_json())
  assert checkpointer.all_steps() == [2, 3]  # orbax's retention: the 2 latest
  state, data, step = checkpointer.restore(abstract_like(small_state(0.0)))
  assert step == 3 and data == {'step': 3} and float(jax.device_get(state['w'])[0]) == 3.0
  checkpointer.close()
  # A step written without the 'run' item (an older checkpoint) still restores.
  old = Checkpointer(str(tmp_path / 'old'), save_every=1)
  old.maybe_save(5, small_state(5.0), {'step': 5})
  old.wait()
  assert old.restore(abstract_like(small_state(0.0)))[1:] == ({'step': 5}, 5)
  old.close()


def test_batch_digest_sees_every_token_shape_and_dtype(tmp_path):
  batch = {'inputs': np.arange(12, dtype=np.int32).reshape(3, 4), 'targets': np.ones((3, 4))}
  same = {k: v.copy() for k, v in reversed(list(batch.items()))}
  assert batch_record.digest(batch) == batch_record.digest(same)
  changed = dict(batch, inputs=batch['inputs'].copy())
  changed['inputs'][2, 3] = 0
  assert batch_record.digest(changed) != batch_record.digest(batch)
  assert batch_record.digest(dict(batch, inputs=batch['inputs'].reshape(
      4, 3))) != (batch_record.digest(batch))
  assert batch_record.digest(dict(batch, inputs=batch['inputs'].astype(
      np.int64))) != (batch_record.digest(batch))
  record = batch_record.BatchRecord(str(tmp_path), enabled=True, is_chief=True)
  record.add(1, dict(batch, index=np.zeros(3)))  # 'index' stays on the host: not recorded
  record.add(2, batch)
  record.add(1, changed)  # step 1 again, after a resume: the last line counts
  assert batch_record.read(
      str(tmp_path)) == {1: batch_record.digest(changed), 2: batch_record.digest(batch)}
  batch_record.BatchRecord(str(tmp_path / 'off'), enabled=False, is_chief=True).add(1, batch)
  assert not os.path.exists(tmp_path / 'off')


def bucketed(process_index=0, process_count=1):
  from transformer_jax.data.batching import BucketedBatcher
  rng = np.random.RandomState(0)
  src = [rng.randint(3, 50, rng.randint(2, 30)).astype(np.int32) for _ in range(200)]
  tgt = [rng.randint(3, 50, rng.randint(2, 30)).astype(np.int32) for _ in range(200)]
  return BucketedBatcher(src, tgt, batch_tokens=256, buckets=[8, 16, 32], seed=3, multiple_of=4,
                         process_index=process_index, process_count=process_count)


def packed(process_index=0, process_count=1):
  from transformer_jax.data.packing import PackedBatcher
  rng = np.random.RandomState(1)
  src = [rng.randint(3, 50, rng.randint(2, 30)).astype(np.int32) for _ in range(200)]
  tgt = [rng.randint(3, 50, rng.randint(2, 30)).astype(np.int32) for _ in range(200)]
  return PackedBatcher(src, tgt, batch_tokens=256, length=32, seed=3, multiple_of=4,
                       process_index=process_index, process_count=process_count)


def windows(process_index=0, process_count=1):
  from transformer_jax.data.lm import RandomWindows
  tokens = np.random.RandomState(2).randint(0, 60, 5000).astype(np.int32)
  return RandomWindows(tokens, block_size=16, batch_size=8, seed=3, process_index=process_index,
                       process_count=process_count)


@pytest.mark.parametrize('make', [bucketed, packed, windows], ids=['bucketed', 'packed', 'windows'])
def test_saved_positions_are_global_whatever_the_process_count(make):
  """Two processes' rows, side by side, are one process's batch; a position saved by a
  2-process run continues in 1 process (and back) with the same global batches."""

  def take(iterator, n):
    return [next(iterator) for _ in range(n)]

  def joined(shares):
    return {k: np.concatenate([s[k] for s in shares]) for k in shares[0]}

  one = make()
  two = [make(i, 2) for i in range(2)]
  one_batches = take(iter(one), 7)
  two_iters = [iter(b) for b in two]
  for step in range(7):
    rows = joined([next(it) for it in two_iters])
    assert batch_record.digest(rows) == batch_record.digest(one_batches[step]), step
  assert two[0].state() == two[1].state() == one.state()
  # 2 processes -> 1: the saved position continues the one stream ...
  continued = make()
  continued.restore(json.loads(json.dumps(two[0].state())))  # as a checkpoint holds it
  reference = take(iter(one), 5)
  for got, want in zip(take(iter(continued), 5), reference):
    assert batch_record.digest(got) == batch_record.digest(want)
  # ... and 1 -> 2.
  back = [make(i, 2) for i in range(2)]
  for batcher in back:
    batcher.restore(continued.state())
  following = take(iter(one), 3)
  back_iters = [iter(b) for b in back]
  for want in following:
    assert batch_record.digest(joined([next(it) for it in back_iters
                                      ])) == (batch_record.digest(want))
