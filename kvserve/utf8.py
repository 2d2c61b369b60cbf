"""Text that is no UTF-8: a lone surrogate (U+D800 to U+DFFF alone), which JSON's "\\ud800" and Python's
surrogateescape (a command line's bytes its locale does not decode) both put in a ``str``, and which neither a
tokenizer nor xgrammar takes (a tokenizer's error names no input: "TextEncodeInput must be Union[...]")."""

from __future__ import annotations


def check_utf8(text: str, what: str) -> str:
    """``text``, or ValueError saying that ``what`` (its name for the user) is not valid UTF-8."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{what} is not valid UTF-8: it holds a lone surrogate (U+D800 to U+DFFF alone)") \
                from None
    return text
