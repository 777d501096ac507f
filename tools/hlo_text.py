"""Reading XLA's optimised HLO text (`jit(f).lower(...).compile().as_text()`).

Used to check what the compiler made of a step: the tests look for transposing copies and
rank-3 dots (tests/test_hlo.py), benchmarks/dot_budget.py times every dot of a train step and
benchmarks/step_profile.py maps a profiler trace onto the step's instructions.
"""

import re

_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%(\S+) = (\S+) (\w[\w-]*)\((.*?)\)(.*)$')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def parse(hlo: str) -> list[dict]:
  """Instructions of every computation (fused ones included): name, shape (e.g.
  'f32[16,64]{1,0}'), opcode, operands, the rest of the line, the JAX op_name and the
  computation it belongs to ('ENTRY' for the program's entry, else its name as
  `called_computation` gives it, e.g. 'fused_computation.3')."""
  result, computation = [], None
  for line in hlo.splitlines():
    if line and not line.startswith(' ') and line.rstrip().endswith('{'):
      computation = 'ENTRY' if line.startswith('ENTRY') else line.split(' ')[0].lstrip('%')
      continue
    match = _INSTRUCTION.match(line)
    if match:
      name, shape, opcode, operands, rest = match.groups()
      op_name = _OP_NAME.search(rest)
      result.append(
          dict(name=name, shape=shape, opcode=opcode, operands=operands, rest=rest,
               op_name=op_name.group(1) if op_name else '', computation=computation))
  return result


def called_computation(instruction: dict) -> str | None:
  """The computation a fusion (or call) runs, e.g. 'fused_computation.3'; None for others."""
  match = re.search(r'calls=%([\w.\-]+)', instruction['rest'])
  return match.group(1) if match else None


def dims(shape: str) -> tuple[int, ...]:
  """(16, 64) for 'f32[16,64]{1,0}'; () for a scalar."""
  inside = re.match(r'\w+\[([^\]]*)\]', shape).group(1)
  return tuple(int(d) for d in inside.split(',')) if inside else ()


def dots(hlo: str) -> list[dict]:
  """Every dot with its operand shapes and dimension numbers: dict(lhs, rhs (shape tuples),
  lhs_contracting, rhs_contracting, lhs_batch, rhs_batch (dimension tuples), op_name)."""
  instructions = parse(hlo)
  shapes = {i['name']: i['shape'] for i in instructions}

  def dimension_numbers(rest: str, key: str) -> tuple[int, ...]:
    match = re.search(key + r'=\{([\d,]*)\}', rest)
    return tuple(int(d) for d in match.group(1).split(',') if d) if match else ()

  result = []
  for i in instructions:
    if i['opcode'] != 'dot':
      continue
    lhs, rhs = (operand.strip().split()[-1].lstrip('%') for operand in i['operands'].split(','))
    result.append(
        dict(
            lhs=dims(shapes[lhs]), rhs=dims(shapes[rhs]), op_name=i['op_name'], **{
                key: dimension_numbers(i['rest'], key)
                for key in ('lhs_contracting_dims', 'rhs_contracting_dims', 'lhs_batch_dims',
                            'rhs_batch_dims')
            }))
  return result
