"""Errors a user can act on: each names what was wrong and where it came from."""


class EgraphCompilerError(Exception):
    """Base class of every error this package raises on purpose."""


class CaptureError(EgraphCompilerError):
    """The program could not be captured as a functional graph."""


class InputError(EgraphCompilerError, TypeError):
    """Arguments that do not match what the program was compiled for."""


class UnsupportedOpError(EgraphCompilerError):
    """An op outside the vocabulary, raised instead of a fallback under strict=True."""


class RuleError(EgraphCompilerError):
    """A rules file that does not parse or does not type-check (file:line:column)."""

    def __init__(self, message, path="<rules>", line=0, column=0, source_line=""):
        self.path, self.line, self.column = path, line, column
        caret = f"\n    {source_line}\n    {' ' * max(column - 1, 0)}^" if source_line else ""
        where = f"{path}:{line}:{column}" if line else path  # (line 0: about the file as a whole)
        super().__init__(f"{where}: {message}{caret}")


class OptionError(EgraphCompilerError, ValueError):
    """A compile option, or a name given to one, that means nothing (a misspelt option or rule)."""


class UnsoundRuleError(EgraphCompilerError):
    """A rule merged two e-classes whose shapes or dtypes differ."""


class CodegenError(EgraphCompilerError):
    """Generated code failed to compile: a bug in the compiler, never the user's."""


class CacheError(EgraphCompilerError):
    """The on-disk kernel cache is unsafe to load from (shared or foreign-owned) or cannot be written."""


class ToolchainError(CodegenError):
    """The C++ compiler (CXX) could not be run at all: a setup problem, not a compiler bug."""


class EagerFallbackWarning(UserWarning):
    """A compiled program (or graph) ran eagerly instead: said once, never silent."""


class CalibrationWarning(UserWarning):
    """This CPU's cost profile could not be measured (a busy machine's readings disagreed), so
    this process prices plans by the fixed table: said once per process, never silent."""


class ScalarMathWarning(UserWarning):
    """Generated C++ was built without glibc's vector math (libmvec): its exp, log, tanh, erf, cos
    and sin are scalar calls, several times slower in a vector loop.  Said once per process."""


class IndexOutOfRange(EgraphCompilerError, IndexError):
    """An embedding's index outside its matrix's rows, found by the generated kernel
    (which read row 0 instead): the call fails, as torch's embedding does."""

    def __init__(self, kernel: str):
        super().__init__(f"index out of range in embedding (kernel {kernel}): every index must be at least 0 and "
                         f"less than the matrix's number of rows")
