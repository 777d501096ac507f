"""benchmarks/hf_parity.py runs end to end: its last stdout line is the JSON of the figures, and
the figures say what the parity tests say (import and export within 1e-4, greedy ids identical,
import(export(params)) bitwise). An unknown family is one error line and exit status 1.
"""

import json
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, TranslateCli

BENCHMARK = 'benchmarks/hf_parity.py'
FIGURES = {
    'import_max_abs_diff', 'greedy_identical', 'greedy_total', 'greedy_agreement',
    'export_max_abs_diff', 'export_class', 'export_missing_keys', 'export_unexpected_keys',
    'round_trip_bitwise', 'round_trip_config_equal', 'max_abs_logit', 'seconds'
}


def _run(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, BENCHMARK, *args], cwd=REPO_ROOT, env=TranslateCli.env(),
                        capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parity
def test_quick_gpt2_run_reports_parity_as_json():
  pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
  pytest.importorskip('transformers', reason='needs the parity extra: pip install -e ".[parity]"')
  result = _run('--families=gpt2', '--quick')
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert {'date', 'commit', 'cpu', 'transformers', 'torch', 'jax', 'families'} <= set(report)
  assert report['cpu'] and report['new_tokens'] == 8
  assert list(report['families']) == ['gpt2']
  gpt2 = report['families']['gpt2']
  assert FIGURES <= set(gpt2)
  assert gpt2['max_abs_logit'] > 0.5  # the differences are not between near-zero logits
  assert gpt2['import_max_abs_diff'] <= 1e-4 and gpt2['export_max_abs_diff'] <= 1e-4
  assert gpt2['greedy_total'] == 2 * 8 and gpt2['greedy_agreement'] == 1.0
  assert gpt2['export_class'] == 'GPT2LMHeadModel'
  assert gpt2['export_missing_keys'] == gpt2['export_unexpected_keys'] == []
  assert gpt2['round_trip_bitwise'] is True and gpt2['round_trip_config_equal'] is True
  # One readable line per family on stderr.
  assert any(line.startswith('gpt2') and '[ok]' in line for line in result.stderr.splitlines())


def test_unknown_family_is_one_error_line():
  result = _run('--families=gpt2,gpt3')
  assert result.returncode == 1
  assert result.stdout == ''
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert errors == [
      "error: --families: unknown family 'gpt3'; known: gpt2,llama,opt,t5_v1_0,t5_v1_1,bert,"
      'albert,roberta'
  ]
