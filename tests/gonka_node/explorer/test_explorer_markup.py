"""Pages are escaped by construction: text and attribute values from anywhere come out as text."""

from __future__ import annotations

from gonka_node.explorer.charts import loss_chart
from gonka_node.explorer.markup import Markup, el, join


def test_text_and_attributes_are_escaped_and_only_markup_passes() -> None:
    hostile = '<script>alert("x")</script>'
    assert el("td", hostile, data_host=hostile) == (
        '<td data-host="&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;">'
        "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;</td>"
    )
    assert el("p", el("b", "ok"), [hostile, None, 3]) == "<p><b>ok</b>&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;3</p>"
    assert join(["<i>", Markup("<i>")]) == "&lt;i&gt;<i>"


def test_links_only_point_at_this_server() -> None:
    for bad in ("javascript:alert(1)", "data:text/html,x", "//evil.example/x", "/\\evil.example", "https://evil.example"):
        assert el("a", "x", href=bad) == '<a href="#">x</a>', bad
    assert el("a", "x", href="/hosts/0xAb") == '<a href="/hosts/0xAb">x</a>'


def test_the_loss_chart_has_one_point_per_reported_round() -> None:
    svg = loss_chart([{"round": 0, "loss": 5.5}, {"round": 1, "loss": 4.5}, {"round": 2, "loss": 3.5}])
    assert svg.count('class="loss-point"') == 3 and 'data-round="2" data-loss="3.500000"' in svg
    assert svg.count("<polyline") == 1 and "<script" not in svg
