"""What any text shown to a person or written to a log goes through: passwords masked, and the control
characters of text from data or from a peer escaped."""
import re

# user:password@ in a URL, and password=... in a connection string or JDBC properties.
_URL_PASSWORD = re.compile(r"(?P<keep>[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*:)[^\s/]*@")
_KEYWORD_PASSWORD = re.compile(r"(?P<keep>\bpassword['\"]?\s*[=:]\s*['\"]?)[^'\"\s&;,)}]+", re.IGNORECASE)
# C0 and C1 control characters, DEL among them.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def mask_passwords(text: str) -> str:
    """The text with every password in a URL or a key=value setting replaced by ***."""
    return _KEYWORD_PASSWORD.sub(r"\g<keep>***", _URL_PASSWORD.sub(r"\g<keep>***@", text))


def visible(text: str) -> str:
    """Text with control characters (an escape sequence's ESC among them) written as \\xNN, not acted on: a NUL,
    which PostgreSQL's text refuses, a terminal's escape sequences, a line break that would forge a log line."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)
