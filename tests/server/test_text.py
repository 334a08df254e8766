"""Incremental text: split characters and possible stop-string starts are held back."""

from lowbit.server import TextStream


class _Bytes:
    """A tokenizer whose tokens are bytes."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_split_character_waits_for_its_last_byte():
    s = TextStream(_Bytes())
    e_acute = list("é".encode())
    assert s.add([ord("a"), e_acute[0]]) == ""
    assert s.add([e_acute[1]]) == "aé"
    assert s.finish() == ""


def test_a_stop_string_ends_the_text_before_it_even_across_tokens():
    s = TextStream(_Bytes(), stop=("END",))
    assert s.add(list(b"abc E")) == "abc "  # "E" may start the stop string
    assert s.add(list(b"N")) == ""
    assert s.add(list(b"Dxyz")) == "" and s.stopped
    assert s.finish() == ""


def test_a_false_start_is_released():
    s = TextStream(_Bytes(), stop=("END",))
    assert s.add(list(b"EN")) == ""
    assert s.add(list(b"x")) == "ENx"
    assert s.finish() == ""
