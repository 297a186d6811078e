import re
import sys
s = open(sys.argv[1]).read()
s = s.replace('#include <cuda_runtime.h>', '#include "cuda_emu.h"')
# the kernel headers are transformed too (run.sh): "x.cuh" -> "x.emu.h"
s = re.sub(r'#include "(\w+)\.cuh"', r'#include "\1.emu.h"', s)
s = s.replace('#include "cublas_api.h"', '#include "cublas_api.emu.h"')
s = re.sub(r'extern __shared__ float (\w+)\[\];', r'float *\1 = emu_smem;', s)
s = s.replace('__shared__', 'static')
# kernel<<<g, b, smem, st>>>(args); kernel<T, U, true> <<<...>>> (templates, a line break before <<<)
def launch(m):
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
open(sys.argv[2], 'w').write(s)
