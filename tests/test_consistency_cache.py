"""consistency.signature remembers fingerprints (issue 37): the remembered
value must be what formatting the facts gives, and facts that compare equal
but print differently (1, 1.0, True) must not share one."""

import zlib

from commlib import consistency


def _fresh(op, facts, context):
    return zlib.crc32(consistency.describe(op, facts, context).encode())


def test_remembered_signature_is_the_formatted_one():
    context = (("window", 4),)
    for _ in range(3):
        assert consistency.signature("moe.dispatch", ("k=8", "dtype bfloat16"), context) \
            == _fresh("moe.dispatch", ("k=8", "dtype bfloat16"), context)


def test_equal_facts_that_print_differently_keep_their_own_signature():
    seen = {}
    for fact in (1, 1.0, True, 1, True, 1.0):
        value = consistency.signature("op", (fact,), ())
        assert value == _fresh("op", (fact,), ())
        seen.setdefault(repr(fact), value)
    assert len(set(seen.values())) == 3


def test_an_equal_but_different_context_is_formatted_again():
    first = (("scale", 1),)
    second = (("scale", 1.0),)
    assert consistency.signature("op", ("a",), first) == _fresh("op", ("a",), first)
    assert consistency.signature("op", ("a",), second) == _fresh("op", ("a",), second)
    assert consistency.signature("op", ("a",), first) != consistency.signature("op", ("a",),
                                                                              second)


def test_unhashable_facts_are_formatted_every_time():
    assert consistency.signature("op", ([1, 2],), ()) == _fresh("op", ([1, 2],), ())
