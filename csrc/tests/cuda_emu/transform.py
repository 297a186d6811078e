"""Rewrites a CUDA source (.cu / .cuh) of csrc/cuda/kernels for the host emulator (run.sh):
cuda_emu.h for the runtime, the kernel headers and cublas_api.h for their rewritten copies,
dynamic shared memory as the emulator's block buffer, a static __shared__ array as a static
array poisoned (emu_poison) when a block first reaches it, and every kernel<<<grid, block,
smem, stream>>>(args) launch as emu_launch.  Usage: transform.py IN OUT."""
import re
import sys

s = open(sys.argv[1]).read()
s = s.replace('#include <cuda_runtime.h>', '#include "cuda_emu.h"')
# the kernel headers are transformed too (run.sh): "x.cuh" -> "x.emu.h"
s = re.sub(r'#include "(\w+)\.cuh"', r'#include "\1.emu.h"', s)
s = s.replace('#include "cublas_api.h"', '#include "cublas_api.emu.h"')
s = re.sub(r'extern __shared__ float (\w+)\[\];', r'float *\1 = emu_smem;', s)


def shared(m):
    """__shared__ T a[..][..], b[..]; -> static T a[..][..], b[..]; emu_poison(a, ...); ..."""
    decl = m.group(1)
    head, tail = decl[:decl.index('[')], decl[decl.index('['):]
    names = [head.split()[-1]] + re.findall(r',\s*(\w+)\s*\[', tail)
    poison = ' '.join(f'emu_poison({n}, sizeof {n});' for n in names)
    return f'static {decl}; {poison}'


s = re.sub(r'__shared__\s+([^;\[]+\[[^;]*);', shared, s)
if '__shared__' in s:
    sys.exit(f'{sys.argv[1]}: a __shared__ declaration transform.py does not know')


def launch(m):
    """kernel<<<g, b, smem, st>>>(args); kernel<T, U, true> <<<...>>> (templates, a line break before <<<)"""
    name, cfg, args = m.group(1), m.group(2), m.group(3)
    parts, depth, cur = [], 0, ''
    for ch in cfg:
        if ch == ',' and depth == 0:
            parts.append(cur.strip())
            cur = ''
            continue
        depth += (ch == '(') - (ch == ')')
        cur += ch
    parts.append(cur.strip())
    g, b, sm = parts[0], parts[1], parts[2]
    return f'emu_launch(dim3({g}), dim3({b}), (size_t)({sm}), [&] {{ {name}({args}); }});'


s = re.sub(r'([\w:]+(?:<[\w, ]+>)?)\s*<<<(.*?)>>>\((.*?)\);', launch, s, flags=re.S)
if '<<<' in s:
    sys.exit(f'{sys.argv[1]}: a kernel launch transform.py does not know')
open(sys.argv[2], 'w').write(s)
