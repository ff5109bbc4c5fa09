"""Coverage-guided fuzzing of the page parser and every engine mapping, with atheris.

Usage: python tests/bench/fuzz_parse.py [--skip-known] [libFuzzer flags] [CORPUS_DIR ...]
       e.g. python tests/bench/fuzz_parse.py -max_total_time=60 /tmp/fuzz-corpus

Not collected by pytest (the name does not start with ``test_``); needs ``pip install
atheris``. The first input byte picks the engine, the rest is the response body. A crash
is anything a scrape would not turn into a failure reason: an exception other than
``ParseError``/``ContractError`` from ``mapping.read``, or any exception from
``stats_fields`` on what it returned (the worker writes that next).

Without a corpus directory, the captured pages in tests/data seed a temporary one.
``--skip-known`` ignores the bug classes tests/scrape/test_hostile_pages.py already documents as
strict xfails (+Inf/overflow and NaN reaching int(), superscript digits in max_lora), so
a run can look past them for new ones.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

with atheris.instrument_imports(include=["poller"]):
    from poller.errors import ContractError, ParseError
    from poller.schema.stats import stats_fields
    from poller.scrape.engines import ENGINE_SPECS, mapping_for
    from poller.scrape.parse import decode_body, looks_like_exposition, parse, parse_all

ENGINES = sorted(name for name, spec in ENGINE_SPECS.items() if spec.scraped)
MAPPINGS = [mapping_for(engine) for engine in ENGINES]
KNOWN = (
    "cannot convert float infinity to integer",
    "cannot convert float NaN to integer",
    "invalid literal for int() with base 10",
)
SKIP_KNOWN = "--skip-known" in sys.argv


def one_input(data: bytes) -> None:
    if not data:
        return
    mapping = MAPPINGS[data[0] % len(MAPPINGS)]
    body = data[1:]
    try:
        text = decode_body(body)
    except ParseError:
        text = None
    if text is not None:
        looks_like_exposition(text)
        for call in (lambda: parse(text, mapping.selector), lambda: parse_all(text)):
            try:
                call()
            except ParseError:
                pass
    try:
        try:
            signals = mapping.read(body)
        except (ParseError, ContractError):
            return
        stats_fields(
            signals,
            prefix_cache_hit_rate=signals.prefix_cache_hit_rate,
            scrape_ms=1.0,
            interval_ms=1000,
        )
    except (OverflowError, ValueError) as exc:
        if SKIP_KNOWN and str(exc).startswith(KNOWN):
            return
        raise


def dictionary(directory: Path) -> str:
    """libFuzzer tokens: every wanted metric name and the spellings that matter."""
    tokens = {name for mapping in MAPPINGS for name in mapping.wanted}
    tokens |= {"+Inf", "-Inf", "NaN", "1e308", "9" * 40, "{", "}", '="', '",', "\\\\", "\\n"}
    tokens |= {"# TYPE ", "# EOF", "\r\n", "max_lora", "\u00b2", "\ufeff"}
    path = directory / "tokens.dict"
    path.write_text("".join(f'"{_escape(t.encode())}"\n' for t in sorted(tokens)))
    return str(path)


def _escape(token: bytes) -> str:
    """libFuzzer's dictionary syntax: printable ASCII as is, anything else as \\xNN."""
    return "".join(chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\x{b:02x}" for b in token)


def seed_corpus() -> str:
    """A temporary corpus: every captured page once per engine (engine byte + page)."""
    corpus = Path(tempfile.mkdtemp(prefix="fuzz-parse-"))
    for page in sorted((ROOT / "tests" / "data").glob("*.txt")):
        for index in range(len(ENGINES)):
            (corpus / f"{index}-{page.stem}").write_bytes(bytes([index]) + page.read_bytes())
    return str(corpus)


def main() -> None:
    argv = [a for a in sys.argv if a != "--skip-known"]
    if not any(not a.startswith("-") for a in argv[1:]):
        argv.append(seed_corpus())
    if not any(a.startswith("-dict=") for a in argv):
        argv.append("-dict=" + dictionary(Path(tempfile.mkdtemp(prefix="fuzz-dict-"))))
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
