"""Tests for poller.scrape.parse: hand-written pages, real captures, and property tests.

The oracle is prometheus_client's full text parser. Two of its habits are undone before
comparing: it renames a counter's samples to ``<name>_total`` when the TYPE line lacks
the suffix (TGI writes counters so), and it returns ints for integer values.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from poller.errors import ParseError, ScrapeError
from poller.scrape.parse import (
    Sample,
    Selector,
    decode_body,
    looks_like_exposition,
    parse,
    parse_all,
)
from tests.support.paths import DATA

PAGES = sorted(DATA.glob("*.txt"))
VLLM_WANTED = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hit_rate",
    "vllm:lora_requests_info",
    "vllm:num_requests_swapped",
]
# Pages prometheus_client cannot parse, with the reason; they get our own checks only.
REJECTED_BY_PROMETHEUS_CLIENT: dict[str, str] = {}

Key = tuple[str, tuple[tuple[str, str], ...], Any]


def key(name: str, labels: dict[str, str], value: float) -> Key:
    """A hashable sample where NaN equals NaN and 1 equals 1.0."""
    return (name, tuple(sorted(labels.items())), "NaN" if math.isnan(value) else float(value))


def keys(samples: Iterable[Sample]) -> list[Key]:
    return [key(*s) for s in samples]


def reference(text: str, written: set[str]) -> Counter[Key]:
    """prometheus_client's samples, with counter names as written on the page."""
    out: Counter[Key] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if (
                family.type == "counter"
                and name not in written
                and name.endswith("_total")
                and name[:-6] in written
            ):
                name = name[:-6]
            out[key(name, s.labels, s.value)] += 1
    return out


def one(text: str, name: str = "foo") -> Sample:
    samples = parse(text, [name])
    assert len(samples) == 1, samples
    return samples[0]


# --- locating wanted lines ---------------------------------------------------------------


def test_simple_page() -> None:
    text = '# HELP foo A gauge.\n# TYPE foo gauge\nfoo{model_name="m",engine="0"} 17.0\nbar 2\n'
    assert parse(text, ["foo", "bar"]) == [
        Sample("foo", {"model_name": "m", "engine": "0"}, 17.0),
        Sample("bar", {}, 2.0),
    ]
    assert parse_all(text) == parse(text, {"foo", "bar"})


def test_name_must_end_at_brace_space_or_tab() -> None:
    text = 'foo_bucket{le="1"} 1\nfoo_sum 2\nfoo_count 3\nfoo:x 4\nfoox 5\nfoo 6\nfoo\t7\nfoo{} 8\n'
    assert [s.value for s in parse(text, ["foo"])] == [6, 7, 8]
    assert [s.value for s in parse(text, ["foo_sum", "foo:x"])] == [2, 4]


def test_name_at_offset_zero_and_after_blank_lines() -> None:
    assert one("foo 1").value == 1
    assert one("\n\nfoo 1\n").value == 1
    assert one('foo{a="b"} 1\nbar 2').labels == {"a": "b"}


def test_comments_and_label_values_are_never_samples() -> None:
    text = (
        "# foo 1\n# HELP foo foo 2\n# TYPE foo gauge\n#foo 3\n  # foo 4\n"
        'bar{x="\\nfoo 5",y="foo 6"} 7\n'
        "# EOF\n"
    )
    assert parse(text, ["foo"]) == []
    assert parse_all(text) == [Sample("bar", {"x": "\nfoo 5", "y": "foo 6"}, 7.0)]


def test_duplicates_are_all_returned_in_page_order() -> None:
    text = 'b 1\na{x="1"} 2\nb 3\na{x="1"} 4\nc 5\na{x="1"} 6\n'
    got = parse(text, ["a", "b", "z"])
    assert [(s.name, s.value) for s in got] == [("b", 1), ("a", 2), ("b", 3), ("a", 4), ("a", 6)]


def test_absent_names_empty_wanted_and_selector() -> None:
    text = "foo 1\n"
    assert parse(text, ["nope", "also_nope"]) == []
    assert parse(text, []) == []
    assert parse(text, set()) == []
    selector = Selector(["foo", "bar"])
    assert parse(text, selector) == parse(text, ("foo", "bar")) == [Sample("foo", {}, 1.0)]
    assert "bar" in repr(selector)


@pytest.mark.parametrize("bad", ["", "foo bar", "foo{", "3foo", "a.b", "foo\n"])
def test_selector_rejects_invalid_names(bad: str) -> None:
    with pytest.raises(ValueError, match="not a metric name"):
        Selector([bad])
    with pytest.raises(ValueError):
        parse("foo 1", [bad])


def test_a_single_string_is_not_a_collection_of_names() -> None:
    with pytest.raises(TypeError):
        parse("foo 1", "foo")
    with pytest.raises(TypeError):
        Selector("foo")


# --- labels ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "value"),
    [
        (r"a\"b", 'a"b'),
        (r"a\\b", "a\\b"),
        (r"a\nb", "a\nb"),
        (r"a\tb", "a\\tb"),  # unknown escapes are kept as written, like prometheus_client
        (r"\\n", "\\n"),  # an escaped backslash followed by n, not a newline
        (r"\\\"", '\\"'),
        (r"\\", "\\"),
        (r"C:\\dir\\", "C:\\dir\\"),
        (r"\q\\\n", "\\q\\\n"),
        ("", ""),
        ("ünïcödé ✓ 模型", "ünïcödé ✓ 模型"),
    ],
)
def test_label_value_escapes_match_prometheus_client(written: str, value: str) -> None:
    text = f'foo{{a="{written}",b="x"}} 1\n'
    assert one(text).labels == {"a": value, "b": "x"}
    [family] = text_string_to_metric_families(text)
    assert family.samples[0].labels["a"] == value


@pytest.mark.parametrize(
    "written", ["}", ",", "=", "#", " # ", "{", "a} 1", 'x=\\"y\\",z', "}{,=#\\\\"]
)
def test_label_values_with_syntax_characters(written: str) -> None:
    text = f'foo{{a="{written}",b="{written}"}} 2 # {{t="1"}} 3\n'
    sample = one(text)
    assert sample.value == 2
    assert set(sample.labels) == {"a", "b"}
    assert sample.labels["a"] == sample.labels["b"]


@pytest.mark.parametrize(
    "line",
    [
        'foo{a="1",b="2",} 5',
        'foo{ a = "1" , b="2" } 5',
        'foo{\ta="1",\tb="2"\t} 5',
        'foo {a="1",b="2"} 5',
        'foo{a="1",b="2"}5',
        'foo{a="1",b="2"}\t5',
    ],
)
def test_label_set_spacing_and_trailing_comma(line: str) -> None:
    assert one(line + "\n") == Sample("foo", {"a": "1", "b": "2"}, 5.0)


def test_empty_label_set() -> None:
    assert one("foo{} 5\n") == Sample("foo", {}, 5.0)


# --- values, timestamps, exemplars -------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "value"),
    [
        ("1", 1.0),
        ("-2", -2.0),
        ("+3", 3.0),
        ("1.5", 1.5),
        ("1e3", 1000.0),
        ("-1.5E-3", -0.0015),
        ("2.9831168e+07", 29831168.0),
        ("1.7382173358407154e+09", 1.7382173358407154e09),
        ("+Inf", math.inf),
        ("Inf", math.inf),
        ("-Inf", -math.inf),
        ("1e999", math.inf),
        ("0", 0.0),
        ("-0.0", 0.0),
    ],
)
def test_values(written: str, value: float) -> None:
    sample = one(f"foo {written}\n")
    assert type(sample.value) is float
    assert sample.value == value


@pytest.mark.parametrize("written", ["NaN", "nan", "-nan", "+NaN"])
def test_nan_values(written: str) -> None:
    assert math.isnan(one(f'foo{{a="b"}} {written}\n').value)


@pytest.mark.parametrize(
    "tail",
    [
        "7 1700000000000",
        "7 -1",
        "7\t1700000000000",
        "7 1700000000.123",  # OpenMetrics timestamps are float seconds
        '7 # {trace_id="abc"} 0.5',
        '7 # {trace_id="abc",x="} # {"} 0.5 1700000000.1',
        "7 1700000000000 # {} 1",
        "7   ",
        "7\r",
        "7 #",
    ],
)
def test_timestamps_and_exemplars_are_skipped(tail: str) -> None:
    assert one(f'foo{{le="0.1"}} {tail}\n').value == 7
    assert one(f"foo {tail}\n").value == 7


def test_openmetrics_page() -> None:
    text = (
        "# TYPE rq counter\n# HELP rq Requests.\n"
        'rq_total{code="200"} 3.0 # {trace_id="kk"} 1.0 1.6e9\n'
        'rq_created{code="200"} 1.6e9\n'
        "# TYPE lat histogram\n"
        'lat_bucket{le="0.5"} 1\nlat_bucket{le="+Inf"} 2 # {id="z"} 9.9\n'
        "lat_count 2\nlat_sum 10.4\n"
        "# EOF\n"
    )
    assert keys(parse(text, ["rq_total", "rq_created", "lat_bucket"])) == [
        ("rq_total", (("code", "200"),), 3.0),
        ("rq_created", (("code", "200"),), 1.6e9),
        ("lat_bucket", (("le", "0.5"),), 1.0),
        ("lat_bucket", (("le", "+Inf"),), 2.0),
    ]
    assert len(parse_all(text)) == 6


# --- line structure ----------------------------------------------------------------------


PAGE = (
    "# HELP a A.\n# TYPE a gauge\na 1\n\n"
    "# TYPE b counter\n# HELP b B.\n"
    'b_total{x="1"} 2\n\n\n'
    'c{y="\\""} 3\n'
    "# just a comment\n"
    "d 4"
)


@pytest.mark.parametrize("crlf", [False, True])
@pytest.mark.parametrize("final_newline", [False, True])
@pytest.mark.parametrize("bom", [False, True])
def test_line_endings_final_newline_and_bom(crlf: bool, final_newline: bool, bom: bool) -> None:
    text = PAGE + ("\n" if final_newline else "")
    if crlf:
        text = text.replace("\n", "\r\n")
    if bom:
        text = "\ufeff" + text
    expected = [
        Sample("a", {}, 1.0),
        Sample("b_total", {"x": "1"}, 2.0),
        Sample("c", {"y": '"'}, 3.0),
        Sample("d", {}, 4.0),
    ]
    assert parse_all(text) == expected
    assert parse(text, ["a", "b_total", "c", "d"]) == expected
    assert parse(text, ["a"]) == expected[:1]
    assert looks_like_exposition(text)
    assert parse_all(decode_body(text.encode())) == expected


def test_bom_before_a_sample_on_line_one() -> None:
    assert parse("\ufeffa 1\r\n", ["a"]) == [Sample("a", {}, 1.0)]


def test_decode_body() -> None:
    assert decode_body(b"") == ""
    assert decode_body(b"\xef\xbb\xbfa 1\n") == "a 1\n"
    assert decode_body('m{a="é"} 1'.encode()) == 'm{a="é"} 1'
    with pytest.raises(ParseError) as info:
        decode_body(b'a 1\nb 2\nc{x="\xff"} 3\n')
    err = info.value
    assert isinstance(err, ScrapeError)
    assert err.reason == "parse"
    assert err.line == 3
    assert "byte offset 13" in str(err)
    assert err.excerpt is not None and err.excerpt.startswith('c{x="')


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        'foo{a="unterminated} 1',
        'foo{a="b"}',
        'foo{a="b"} ',
        "foo ",
        "foo\t",
        "foo \r",
        "foo abc",
        "foo 1_000",
        "foo 0x10",
        "foo 1 2 3",
        "foo 1 abc",
        'foo{a="b"} 1 garbage here',
        'foo{a="b"} garbage',
        'foo{a="b" 1',
        'foo{a="b",,c="d"} 1',
        'foo{a="b" c="d"} 1',
        "foo{,} 1",
        "foo{a} 1",
        "foo{a=b} 1",
        'foo{a="b"}} 1',
        'foo{a="b",a="c"} 1',
        'foo{3a="b"} 1',
        'foo{"a"="b"} 1',
        "foo #",
        'foo{a="\\"} 1',
        "foo {{{{ 1",
    ],
)
def test_malformed_wanted_line_raises_parse_error(line: str) -> None:
    text = f"# HELP foo F.\nok 1\n{line}\nok 2\n"
    with pytest.raises(ParseError) as info:
        parse(text, ["foo", "ok"])
    assert info.value.line == 3
    assert info.value.excerpt == line.rstrip("\r")
    assert "line 3" in str(info.value)
    with pytest.raises(ParseError):
        parse_all(text)
    # The same line is invisible when it is not wanted.
    assert parse(text, ["ok"]) == [Sample("ok", {}, 1.0), Sample("ok", {}, 2.0)]


def test_error_excerpt_is_short_and_line_counts_crlf() -> None:
    line = 'foo{a="' + "x" * 500
    with pytest.raises(ParseError) as info:
        parse("a 1\r\n\r\n" + line + "\r\n", ["foo"])
    assert info.value.line == 3
    assert info.value.excerpt == line[:80]


@pytest.mark.parametrize(
    "line",
    ["  foo 1", "\tfoo 1", "3foo 1", "foo", "foo\r", "foo}1", "<html>", '{"a": 1}', "Not Found"],
)
def test_parse_all_rejects_non_sample_lines(line: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_all(f"ok 1\n{line}\n")
    assert info.value.line == 2


def test_whitespace_only_and_indented_comment_lines_are_blank() -> None:
    assert parse_all(" \n\t\r\n  # HELP x\n\x0c\nfoo 1\n") == [Sample("foo", {}, 1.0)]


# --- looks_like_exposition ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        "# HELP foo F.\n# TYPE foo gauge\n",
        "# EOF\n",
        "\ufeff# HELP a\na 1\n",
        'foo{a="b"} 1\nbar NaN\n',
        "a 1\nb 2\nc 3\n<html>\n",  # only the first three sample lines are looked at
    ],
)
def test_looks_like_exposition(text: str) -> None:
    assert looks_like_exposition(text)


@pytest.mark.parametrize(
    "text",
    [
        "<!DOCTYPE html>\n<html><body>502 Bad Gateway</body></html>\n",
        '{"object":"error","message":"Not Found"}',
        "Not Found",
        "404 page not found\n",
        "# comment\nInternal Server Error\n",
        "a 1\nb two\n",
        'foo{a="b} 1\n',
        "  foo 1\n",
    ],
)
def test_does_not_look_like_exposition(text: str) -> None:
    assert not looks_like_exposition(text)


# --- real pages --------------------------------------------------------------------------


def test_there_are_real_pages() -> None:
    assert len(PAGES) >= 7


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_real_page_matches_prometheus_client(page: Path) -> None:
    text = decode_body(page.read_bytes())
    ours = parse_all(text)
    assert ours, "a real page has samples"
    assert looks_like_exposition(text)
    written = {s.name for s in ours}
    for wanted in (VLLM_WANTED, sorted(written)[::3], sorted(written)):
        assert keys(parse(text, wanted)) == keys(s for s in ours if s.name in wanted)
    if page.name in REJECTED_BY_PROMETHEUS_CLIENT:
        return
    try:
        expected = reference(text, written)
    except Exception as exc:  # the oracle's failure, whatever it is, is reported
        pytest.fail(
            f"prometheus_client rejects {page.name} ({exc!r}); if that is expected, add it "
            "to REJECTED_BY_PROMETHEUS_CLIENT with the reason"
        )
    assert Counter(keys(ours)) == expected


def test_vllm_v1_page_values() -> None:
    text = decode_body((DATA / "vllm-v1-synthetic-61k.txt").read_bytes())
    got = parse(text, VLLM_WANTED)
    by_name = {s.name: s.value for s in got}
    assert by_name["vllm:num_requests_running"] == 17.0
    assert by_name["vllm:num_requests_waiting"] == 3.0
    assert by_name["vllm:kv_cache_usage_perc"] == 0.4237
    assert by_name["vllm:prefix_cache_queries_total"] == 5.314951e06
    assert by_name["vllm:prefix_cache_hits_total"] == 1.582691e06
    lora = [s.labels for s in got if s.name == "vllm:lora_requests_info"]
    assert [x["running_lora_adapters"] for x in lora] == [
        "sql-lora",
        "sql-lora",
        "sql-lora,chat-lora",
    ]
    assert "vllm:gpu_cache_usage_perc" not in by_name
    assert len(got) == 8


def test_partial_aibrix_page_ends_mid_histogram() -> None:
    # Both parsers accept it: neither checks that a histogram has +Inf, _sum and _count.
    text = decode_body((DATA / "vllm-v0-0.7-aibrix-docs-lora-info-partial.txt").read_bytes())
    # It stops at le="96.0": no +Inf bucket and no _count (_sum came before the buckets).
    buckets = parse(text, ["vllm:iteration_tokens_total_bucket"])
    assert [s.labels["le"] for s in buckets][-1] == "96.0"
    assert all(s.labels["le"] != "+Inf" for s in buckets)
    assert parse(text, ["vllm:iteration_tokens_total_count"]) == []
    [total] = parse(text, ["vllm:iteration_tokens_total_sum"])
    assert total.value == 1103.0
    [lora] = parse(text, ["vllm:lora_requests_info"])
    assert lora.labels == {
        "max_lora": "0",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert lora.value == 1.7382173358407154e09
    [rate] = parse(text, ["vllm:gpu_prefix_cache_hit_rate"])
    assert rate.value == -1.0


def test_tgi_counters_keep_their_written_names() -> None:
    text = decode_body((DATA / "tgi-datadog-payload-excerpt.txt").read_bytes())
    assert parse(text, ["tgi_request_count"]) == [Sample("tgi_request_count", {}, 111.0)]
    renamed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "tgi_request_count_total" in renamed  # prometheus_client's renaming, undone above


# --- property tests: generated pages -----------------------------------------------------

METRIC_NAMES = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,12}", fullmatch=True).filter(
    lambda n: n.removesuffix("_total") != ""
)
LABEL_NAMES = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True).filter(
    lambda n: not n.startswith("__")  # reserved; prometheus_client rejects them
)
LABEL_VALUES = st.text(
    st.one_of(st.sampled_from('"\\\n}{,=# \t\r'), st.characters(codec="utf-8")), max_size=10
)
FINITE = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def values(draw: st.DrawFn) -> tuple[str, float]:
    kind = draw(st.sampled_from(["float", "int", "nan", "inf"]))
    if kind == "nan":
        return draw(st.sampled_from(["NaN", "nan", "-nan"])), math.nan
    if kind == "inf":
        sign = draw(st.sampled_from([-1.0, 1.0]))
        spelled = draw(st.sampled_from(["Inf", "inf"] if sign > 0 else ["-Inf", "-inf"]))
        return (("+" if sign > 0 and draw(st.booleans()) else "") + spelled), sign * math.inf
    if kind == "int":
        i = draw(st.integers(-(10**20), 10**20))
        return str(i), float(i)
    f = draw(FINITE)
    spelled = draw(st.sampled_from([repr(f), f"{f:e}", f"{f:.17g}", f"{f:E}"]))
    return spelled, float(spelled)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def sample_lines(draw: st.DrawFn, base: str) -> tuple[str, Sample]:
    name = base + draw(st.sampled_from(["", "", "_bucket", "_sum", "_count", "_total", "_created"]))
    labels = draw(st.dictionaries(LABEL_NAMES, LABEL_VALUES, max_size=3))
    written, value = draw(values())
    exemplar = draw(st.booleans())
    gap = st.just(" ") if exemplar else st.sampled_from([" ", "\t", "  "])
    line = name
    if bool(labels) or draw(st.booleans()):
        pad = draw(st.sampled_from(["", " "]))
        pairs = [f'{pad}{k}{pad}={pad}"{escape(v)}"{pad}' for k, v in labels.items()]
        comma = "," if bool(labels) and draw(st.booleans()) else ""
        line += draw(st.sampled_from(["", " "])) + "{" + ",".join(pairs) + comma + "}"
    line += draw(gap) + written
    if draw(st.booleans()):
        line += draw(gap) + str(draw(st.integers(-(2**40), 2**45)))
    if exemplar:
        line += f' # {{trace_id="{draw(st.integers(0, 99))}"}} {draw(FINITE)!r}'
    return line, Sample(name, labels, value)


@st.composite
def pages(draw: st.DrawFn) -> tuple[str, list[Sample]]:
    lines: list[str] = []
    expected: list[Sample] = []
    for base in draw(st.lists(METRIC_NAMES, min_size=1, max_size=5)):
        for kind in draw(st.lists(st.sampled_from(["help", "type", "comment"]), unique=True)):
            if kind == "help":
                doc = draw(st.text(st.characters(codec="utf-8"), max_size=15))
                lines.append(f"# HELP {base} " + doc.replace("\\", "\\\\").replace("\n", "\\n"))
            elif kind == "type":
                typ = draw(st.sampled_from(["counter", "gauge", "histogram", "summary", "untyped"]))
                lines.append(f"# TYPE {base} {typ}")
            else:
                lines.append("# " + draw(st.from_regex(r"[a-z0-9 {}\"=,.]{0,15}", fullmatch=True)))
        for line, sample in draw(st.lists(sample_lines(base), max_size=4)):
            lines.append(line)
            expected.append(sample)
        if draw(st.booleans()):
            lines.append("")
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    text = eol.join(lines) + (eol if draw(st.booleans()) else "")
    return text, expected


def canonical(samples: Iterable[Key]) -> Counter[Key]:
    """Names without one trailing _total: prometheus_client appends it to some counters."""
    return Counter((n.removesuffix("_total"), labels, v) for n, labels, v in samples)


@pytest.mark.slow  # 300 generated pages through both parsers: seconds
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pages(), st.data())
def test_generated_pages_agree_with_prometheus_client(
    page: tuple[str, list[Sample]], data: st.DataObject
) -> None:
    text, expected = page
    ours = parse_all(text)
    assert keys(ours) == keys(expected)
    theirs = [
        key(s.name, s.labels, s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
    ]
    assert canonical(keys(ours)) == canonical(theirs)
    names = sorted({s.name for s in ours} | {"absent_name"})
    wanted = data.draw(st.sets(st.sampled_from(names)))
    assert keys(parse(text, wanted)) == keys(s for s in ours if s.name in wanted)
    assert looks_like_exposition(text)
    assert keys(parse_all(decode_body(("\ufeff" + text).encode()))) == keys(ours)


# --- fuzzing: nothing but ParseError, and linear time ------------------------------------


def check_only_parse_errors(text: str, wanted: Iterable[str]) -> None:
    """Run every entry point; parse raising implies parse_all raising, and when parse_all
    succeeds, parse must return exactly its wanted subset."""
    looks_like_exposition(text)
    wanted = set(wanted)
    try:
        got: list[Sample] | None = parse(text, wanted)
    except ParseError:
        got = None
    try:
        everything = parse_all(text)
    except ParseError:
        return
    assert got is not None, "parse raised on a page parse_all accepts"
    assert keys(got) == keys(s for s in everything if s.name in wanted)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_bytes(body: bytes) -> None:
    try:
        text = decode_body(body)
    except ParseError:
        return
    check_only_parse_errors(text, ["foo", "a", "vllm:num_requests_running"])


@settings(max_examples=300, deadline=None)
@given(st.text(st.one_of(st.sampled_from('fo{}"\\=, \t\r\n#1.eNaI+-_'), st.characters())))
def test_fuzz_text(text: str) -> None:
    check_only_parse_errors(text, ["foo", "f", "fo", "o"])


@pytest.mark.slow  # 300 mutated pages: seconds
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pages(), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 3), st.text(max_size=3))))
def test_fuzz_mutated_pages(
    page: tuple[str, list[Sample]], edits: list[tuple[int, int, str]]
) -> None:
    text, expected = page
    for at, cut, insert in edits:
        at %= len(text) + 1
        text = text[:at] + insert + text[at + cut :]
    check_only_parse_errors(text, {s.name for s in expected})


MILLION = 1_000_000
HALF = MILLION // 2
ADVERSARIAL = [
    pytest.param("a" * MILLION, ParseError, id="1MB-name"),
    pytest.param("foo " + "1" * MILLION, [Sample("foo", {}, math.inf)], id="1M-digit-value"),
    pytest.param("foo " + "1 " * HALF, ParseError, id="500k-tokens"),
    pytest.param("foo" + "{" * 100_000 + " 1", ParseError, id="100k-braces-after-name"),
    pytest.param("{" * 100_000, ParseError, id="100k-braces"),
    pytest.param("foo{" + 'a="b",' * 100_000 + "} 1", ParseError, id="100k-duplicate-labels"),
    pytest.param(
        'foo{a="' + "x" * MILLION + '"} 1',
        [Sample("foo", {"a": "x" * MILLION}, 1.0)],
        id="1M-value",
    ),
    pytest.param('foo{a="' + "x" * MILLION + "} 1", ParseError, id="1M-unterminated"),
    pytest.param(
        'foo{a="' + "\\\\" * HALF + '"} 1',
        [Sample("foo", {"a": "\\" * HALF}, 1.0)],
        id="500k-escaped-backslashes",
    ),
    pytest.param('foo{a="' + "\\" * (MILLION - 1) + '"} 1', ParseError, id="odd-backslashes"),
    pytest.param(
        'foo{a="' + '\\"' * HALF + '"} 1',
        [Sample("foo", {"a": '"' * HALF}, 1.0)],
        id="500k-escaped-quotes",
    ),
    pytest.param(
        "foo 1\n" * 200_000,
        [Sample("foo", {}, 1.0)] * 200_000,
        id="200k-lines",
        marks=pytest.mark.slow,  # 200,000 samples built and compared: seconds
    ),
    pytest.param("# " + "x" * MILLION + "\nfoo 1", [Sample("foo", {}, 1.0)], id="1MB-comment"),
    pytest.param("\n" * MILLION + "foo 2", [Sample("foo", {}, 2.0)], id="1M-blank-lines"),
    pytest.param(
        'foo{a="b"} 1 # ' + "{" * MILLION, [Sample("foo", {"a": "b"}, 1.0)], id="1MB-exemplar"
    ),
]


@pytest.mark.parametrize(("text", "expected"), ADVERSARIAL)
def test_adversarial_inputs(text: str, expected: list[Sample] | type[ParseError]) -> None:
    if isinstance(expected, list):
        assert parse(text, ["foo"]) == expected
        assert parse_all(text) == expected
        assert looks_like_exposition(text)
    else:
        with pytest.raises(ParseError):
            parse_all(text)
        try:
            parse(text, ["foo"])
        except ParseError:
            pass
        looks_like_exposition(text)
    with pytest.raises(ParseError):
        decode_body(text.encode() + b"\xc3")


def test_a_label_set_read_again_is_the_same_labels_in_a_dict_of_its_own() -> None:
    # Repeated label sets come from a cache: each sample still gets its own dict, and a
    # line whose `}` is not the label set's last (a `#` in a value, an exemplar) is read
    # in full every time.
    page = (
        'a{x="1",y="p}q"} 1\n'
        'a{x="1",y="p}q"} 2\n'
        'b{v="has # and }"} 3\n'
        'b{v="has # and }"} 4\n'
        'c_total{k="v"} 5 # {trace_id="t}"} 1.0\n'
        'c_total{k="v"} 6 # {trace_id="u"} 1.0\n'
    )
    first, second, third, fourth, fifth, sixth = parse_all(page)
    assert first.labels == second.labels == {"x": "1", "y": "p}q"}
    assert first.labels is not second.labels
    first.labels["x"] = "changed"
    assert parse_all(page)[1].labels == {"x": "1", "y": "p}q"}
    assert third.labels == fourth.labels == {"v": "has # and }"}
    assert fifth.labels == sixth.labels == {"k": "v"}
    assert [s.value for s in (fifth, sixth)] == [5.0, 6.0]
