"""Exception types raised by EPL.

Every error names what is wrong and how to fix it. They all derive from
`EPLError`, so a script can catch EPL's errors apart from TensorFlow's.
"""


class EPLError(Exception):
    """Base class of every error EPL raises on purpose."""

    # raised while a tf.function is traced, it reaches the user as it is: autograph
    # passes it through instead of prefixing the message with its own trace
    ag_pass_through = True


class ConfigError(EPLError, ValueError):
    """An unknown configuration key or a value of the wrong type or range."""


class ScopeError(EPLError, RuntimeError):
    """A strategy scope used in a way EPL cannot honour (nesting, bad sizes).

    Also a RuntimeError, as EPL raised one for these (code that catches
    RuntimeError around its scopes keeps working)."""


class ClusterError(EPLError):
    """The requested layout does not fit the devices that are available."""


class ParallelizeError(EPLError):
    """The graph cannot be parallelized as annotated (raised before any rewrite)."""


class PassError(EPLError):
    """A graph pass failed; the message names the pass and the passes before it."""


class CaptureError(EPLError):
    """`epl.capture` could not capture a training script's graph (missing file, the
    script failed, or it built no graph)."""


class CheckpointError(EPLError, OSError):
    """A checkpoint that cannot be read (a file missing or damaged) or written (a full
    disk, a removed directory); the message names the file and what is wrong."""
