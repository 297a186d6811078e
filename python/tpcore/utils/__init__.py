"""The ground floor of the package: helpers every other subpackage may use.

- `runtime`: the C extension loaded once; build_info, threads, convert.
- `args`: argument checks that name the call, the argument, what was expected and what came.
- `arrays`: host and device arrays (NumPy, DLPack, DeviceArray) and their checks.
- `dtypes`: the one vocabulary of dtypes and weight formats, read from the C core's table.
- `cuda`: finding and loading the CUDA plugin and the GPU libraries a user has.
- `cleanup`: this job's shared-memory names, removed however the job ends.

Imports: only tpcore._C, the standard library and NumPy; nothing else of tpcore.
"""
