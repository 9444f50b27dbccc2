"""The project's Python sources as syntax trees, for the tests that read the code."""
import ast


def syntax_tree(source: str) -> ast.Module:
    """ast.parse, asked again when CPython 3.11 miscounts: its tree builder keeps one recursion counter for the whole
    process and, rarely, with other threads running, raises a spurious SystemError "AST constructor recursion depth
    mismatch" (CPython issue 106905).  A source that does not parse still fails at once, with SyntaxError."""
    for _ in range(2):
        try:
            return ast.parse(source)
        except SystemError as miscount:
            if "recursion depth mismatch" not in str(miscount):
                raise
    return ast.parse(source)
