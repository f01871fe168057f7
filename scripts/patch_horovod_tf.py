#!/usr/bin/env python3
"""Make Horovod 0.28.1's TensorFlow GPU ops load under TensorFlow 2.21.

horovod/tensorflow/mpi_ops.cc declares
``stream_executor::gpu::AsGpuStreamValue(Stream*)`` and calls it to get the
CUDA stream of an op's device context. TensorFlow 2.21 no longer exports
that function (neither libtensorflow_framework.so.2 nor libtensorflow_cc.so.2
of the tensorflow 2.21.0 wheel defines it), so a GPU build of Horovod would
fail to load with an undefined symbol. This script replaces the declaration
with an inline definition through TensorFlow's public API,
``Stream::platform_specific_handle().stream`` (the CUDA stream), placed after
stream.h is included.

scripts/build_horovod.sh runs it on the unpacked source for the gpu build only.
usage: patch_horovod_tf.py PATH/TO/horovod/tensorflow/mpi_ops.cc
Exits with an error naming what it did not find if the source differs from
Horovod 0.28.1's.
"""
from __future__ import annotations

import sys

DECLARATION = """// Forward declaration of AsGpuStreamValue
namespace stream_executor {
namespace gpu {
GpuStreamHandle AsGpuStreamValue(Stream* stream);
} // namespace stream_executor
} // namespace gpu
"""

INCLUDES_END = """#include "tensorflow/stream_executor/stream.h"
#endif // TENSORFLOW_VERSION >= 2011000000
"""

DEFINITION = """// EPL (scripts/patch_horovod_tf.py): TensorFlow 2.21 no longer exports
// AsGpuStreamValue; the CUDA stream through the public Stream API instead.
namespace stream_executor {
namespace gpu {
inline GpuStreamHandle AsGpuStreamValue(Stream* stream) {
  return static_cast<GpuStreamHandle>(stream->platform_specific_handle().stream);
}
} // namespace gpu
} // namespace stream_executor
"""


def patch(text: str) -> str:
    """The patched mpi_ops.cc source; ValueError naming a missing anchor."""
    for name, anchor in (("the AsGpuStreamValue declaration", DECLARATION),
                         ("the end of the stream.h includes", INCLUDES_END)):
        if text.count(anchor) != 1:
            raise ValueError(f"expected {name} once in mpi_ops.cc, found it "
                             f"{text.count(anchor)} times; is this Horovod 0.28.1?")
    text = text.replace(DECLARATION, "")
    return text.replace(INCLUDES_END, INCLUDES_END + DEFINITION)


def main(argv: list[str]) -> int:
    """Patch the file named by argv[0] in place."""
    if len(argv) != 1:
        print(__doc__.split("\n\n")[-2], file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        text = f.read()
    try:
        patched = patch(text)
    except ValueError as err:
        print(f"patch_horovod_tf: {argv[0]}: {err}", file=sys.stderr)
        return 1
    with open(argv[0], "w", encoding="utf-8") as f:
        f.write(patched)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
