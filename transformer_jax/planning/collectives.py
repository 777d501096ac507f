"""The collectives of a compiled program, read from XLA's optimised HLO text.

Counts all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute, with the bytes
of their operands (what each device sends into the collective). XLA:TPU's text differs from the
CPU and GPU text that `tools/hlo_text.py` reads:

- operands print as bare names (`%fusion.12`), so their bytes come from the instructions that
  define them;
- layouts carry tiles (`f32[8,128]{1,0:T(8,128)}`);
- most collectives sit inside computations called by fusions (`async_collective_fusion.N`,
  `fused_computation.N` started by `async-collective-start`), and XLA:TPU's reduce-scatter is an
  all-reduce inside an `all-reduce-scatter.N` computation that keeps this device's slice.

XLA:TPU also writes one asynchronous collective into several computations (its start, its
continuation and its done step): copies share the collective's `channel_id`, and each channel is
counted once. A collective inside a loop body counts once, not once per iteration (the train
step has loops only with scan_layers or accumulation).
"""

import collections
import re

KINDS = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'collective-permute')

_BYTES = {
    'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2,
    's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'f8e4m3fn': 1, 'f8e5m2': 1,
    'c64': 8, 'c128': 16
}
_ARRAY = re.compile(r'\b(' + '|'.join(sorted(_BYTES, key=len, reverse=True)) + r')\[([\d,]*)\]')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$')


def array_bytes(text: str) -> int:
  """Bytes of every array shape written in `text` ('f32[8,128]{1,0} ...', tuples included)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(text):
    n = 1
    for d in filter(None, dims.split(',')):
      n *= int(d)
    total += n * _BYTES[dtype]
  return int(total)


def _split(rhs: str):
  """'<shape> opcode(<operands>), attributes' -> (shape, opcode, operands, attributes)."""
  if rhs.startswith('('):  # a tuple shape
    depth, end = 0, len(rhs)
    for position, c in enumerate(rhs):
      depth += (c == '(') - (c == ')')
      if depth == 0:
        end = position + 1
        break
    shape, rest = rhs[:end], rhs[end:].lstrip()
  else:
    shape, _, rest = rhs.partition(' ')
  match = re.match(r'([\w\-]+)\(', rest)
  if not match:
    return None
  depth = 1
  for j in range(match.end(), len(rest)):
    depth += (rest[j] == '(') - (rest[j] == ')')
    if depth == 0:
      return shape, match.group(1), rest[match.end():j], rest[j + 1:]
  return None


def collectives(hlo: str) -> list[dict]:
  """[{kind, name, computation, operand_bytes, result_bytes, replica_groups}] in text order."""
  parsed, shapes = [], {}
  computation = None
  for line in hlo.splitlines():
    if line and not line.startswith(' ') and line.rstrip().endswith('{'):
      computation = 'ENTRY' if line.startswith('ENTRY') else line.split(' ')[0].lstrip('%')
      continue
    match = _INSTRUCTION.match(line)
    parts = match and _split(match.group(2))
    if parts:
      shapes[match.group(1)] = parts[0]
      parsed.append((computation, match.group(1), parts))
  found, channels = [], set()
  for computation, name, (shape, opcode, operands, attributes) in parsed:
    if opcode.endswith('-done'):
      continue
    kind = next((k for k in KINDS if opcode.startswith(k)), None)
    if kind is None and opcode == 'fusion':  # XLA:TPU names some fusions by their collective
      kind = next((k for k in KINDS if name.startswith(k)), None)
    if kind is None:
      continue
    if kind == 'all-reduce' and (computation or '').startswith('all-reduce-scatter'):
      kind = 'reduce-scatter'
    channel = re.search(r'channel_id=(\d+)', attributes)
    if channel:
      if (kind, channel.group(1)) in channels:
        continue  # another copy of an asynchronous collective already counted
      channels.add((kind, channel.group(1)))
    if _ARRAY.search(operands):  # typed operands (CPU and GPU text)
      operand_bytes = array_bytes(operands)
    else:
      operand_bytes = sum(
          array_bytes(shapes.get(operand, '')) for operand in re.findall(r'%([\w.\-]+)', operands))
    groups = re.search(r'replica_groups=(.*?)(?:, [a-z_]+=|$)', attributes)
    found.append(
        dict(kind=kind, name=name, computation=computation, operand_bytes=operand_bytes,
             result_bytes=array_bytes(shape), replica_groups=groups.group(1) if groups else ''))
  return found


def summary(hlo: str) -> dict[str, dict[str, int]]:
  """{kind: {'count', 'bytes'}} for each kind of collective in the program (bytes: operands)."""
  table = collections.defaultdict(lambda: {'count': 0, 'bytes': 0})
  for c in collectives(hlo):
    table[c['kind']]['count'] += 1
    table[c['kind']]['bytes'] += c['operand_bytes']
  return {kind: dict(table[kind]) for kind in KINDS if kind in table}
