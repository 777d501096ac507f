"""XLA flags and compiler options: the table in `transformer_jax.xla_options` against the
installed jaxlib, in both directions, and every flag the code spells out is in the table."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from transformer_jax import xla_options

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

# A value each name accepts, to try it with.
SAMPLE_VALUES = {
    'xla_backend_optimization_level': 0,
    'xla_cpu_use_fusion_emitters': False,
    'xla_force_host_platform_device_count': 2,
    'xla_cpu_experimental_ynn_fusion_type': '',
    'xla_cpu_use_onednn': False,
    'xla_cpu_experimental_onednn_fusion_type': '',
}
# Names XLA reads from XLA_FLAGS only (client flags), not per compilation.
NOT_COMPILER_OPTIONS = {'xla_force_host_platform_device_count'}


def start_jax(xla_flags: str) -> subprocess.CompletedProcess:
  """A fresh process that starts jax's CPU backend with `xla_flags` as its XLA_FLAGS."""
  env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-c', 'import jax; print(jax.device_count())'], env=env,
                        capture_output=True, text=True, timeout=300, check=False)


def test_every_name_in_the_table_has_a_sample_value():
  assert set(SAMPLE_VALUES) == set(xla_options.KNOWN)


def test_the_flags_the_table_calls_known_start_the_installed_jaxlib():
  known = xla_options.flags(**SAMPLE_VALUES)
  assert known, 'no flag known to this jaxlib'
  result = start_jax(' '.join(known))
  assert result.returncode == 0, result.stderr[-2000:]
  expected_devices = 2 if xla_options.knows('xla_force_host_platform_device_count') else 1
  assert result.stdout.split()[-1] == str(expected_devices)


def test_the_flags_the_table_calls_unknown_abort_the_installed_jaxlib():
  """The other direction: the table is not merely cautious. Each name it leaves out for this
  jaxlib really is unknown to it (XLA aborts), so the bounds are facts, not guesses. A made-up
  name is tried too, so that the check itself is seen to work on every jaxlib."""
  unknown = {name: value for name, value in SAMPLE_VALUES.items() if not xla_options.knows(name)}
  unknown['xla_no_such_flag_anywhere'] = True
  for name, value in unknown.items():
    result = start_jax(f'--{name}={str(value).lower()}')
    assert result.returncode != 0, name
    assert 'Unknown flag' in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize('name', sorted(set(xla_options.KNOWN) - NOT_COMPILER_OPTIONS))
def test_compiler_options_compile_where_known_and_are_refused_where_not(name):
  value = SAMPLE_VALUES[name]
  options = xla_options.compiler_options(**{name: value})
  if xla_options.knows(name):
    assert options == {name: value}
    assert float(jax.jit(lambda x: x.sum(), compiler_options=options)(jnp.ones(3))) == 3.0
  else:
    assert options == {}
    with pytest.raises(Exception, match='No such compile option'):
      jax.jit(lambda x: x.sum() + 1, compiler_options={name: value})(jnp.ones(3))


def test_every_flag_the_code_spells_out_is_in_the_table():
  """A `--xla_...` written anywhere in the code, tests, benchmarks or scripts (comments and
  docstrings included: they are commands a reader copies) is one the table covers, so the tests
  above check it against each jaxlib CI runs."""
  pattern = re.compile(r'--(xla_[a-z0-9_]+)')
  found = {}
  for folder in ('transformer_jax', 'experiments', 'benchmarks', 'tests', 'tools', 'launch', '.ci'):
    for path in (REPO_ROOT / folder).rglob('*'):
      if path.is_file() and path.suffix in ('.py', '.sh', '') and path != pathlib.Path(__file__):
        for name in pattern.findall(path.read_text(errors='replace')):
          found.setdefault(name, str(path.relative_to(REPO_ROOT)))
  unknown = {name: where for name, where in found.items() if name not in xla_options.KNOWN}
  assert not unknown, f'flags missing from xla_options.KNOWN: {unknown}'


def test_knows_follows_the_bounds():
  assert xla_options.knows('xla_cpu_use_fusion_emitters', '0.10.2')
  assert not xla_options.knows('xla_cpu_use_fusion_emitters', '0.11.2')
  assert not xla_options.knows('xla_cpu_use_fusion_emitters', '0.12.0.1')
  assert xla_options.knows('xla_backend_optimization_level', '0.12.0.1')
  with pytest.raises(KeyError, match='not in xla_options.KNOWN'):
    xla_options.knows('xla_not_a_flag')


def test_version_tuple_reads_release_and_development_versions():
  assert xla_options.version_tuple('0.12.0.1') == (0, 12, 0, 1)
  assert xla_options.version_tuple('0.11.2') < xla_options.version_tuple('0.12.0.1')
  assert xla_options.version_tuple('0.13.0.dev20270101') == (0, 13, 0)
  with pytest.raises(ValueError):
    xla_options.version_tuple('dev')


def test_flags_are_appended_and_replace_an_earlier_value_of_the_same_name():
  env = {'XLA_FLAGS': '--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8'}
  text = xla_options.add_flags(env, '0.12.0.1', xla_force_host_platform_device_count=4,
                               xla_cpu_use_fusion_emitters=False)
  assert text == '--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4'
  assert xla_options.add_flags(
      {}, '0.10.2', xla_cpu_use_fusion_emitters=False) == ('--xla_cpu_use_fusion_emitters=false')
  env = xla_options.host_devices_env(8, {'PATH': '/bin'})
  assert env == {'PATH': '/bin', 'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
