"""Hypothesis strategies built from protobuf message descriptors, so a field added to the proto is fuzzed without
anyone writing its strategy: ``messages(descriptor)`` draws messages whose every field takes hostile values (huge,
negative, NaN and infinite numbers; long, empty and odd Unicode strings; unknown drafter names; empty and large
repeated fields), and ``wire(descriptor)`` draws serialized bytes field by field, with payloads no serializer would
write (strings that are not UTF-8, truncated and wrongly typed fields)."""

from __future__ import annotations

import math
from typing import Any, Literal

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from specd_api.plan import DRAFTER_NAMES

SEGMENT_CHARS = "ABCXYZabcxyz0189_.:/-"
INT_EDGES = [0, 1, -1, 2, 63, 64, 65, 127, 128, 129, 1_000_000, 1_000_001, 10**9, 10**9 + 1]
FLOAT_EDGES = [0.0, -0.0, 1e-7, 1e-300, 5e-324, 0.5, 1.0, 1.0000001, 2.0, 10.0, 60.0, 100.0, 100.5, 3.4e38, 1e308,
               -1.0, math.inf, -math.inf, math.nan]  # fmt: skip
STRING_EDGES = ["", "x", "x" * 128, "x" * 129, "a b", "tenant-*", "_overflow", "../..", "\x00", "é", "😀" * 40,
                "\u202e", "\ufeff", *DRAFTER_NAMES, "Draft", "draft ", "d" * 10_000]  # fmt: skip
MAX_LIST = 8  # repeated fields: short lists mostly; examples add the giant ones

_INT_BITS = {
    FieldDescriptor.TYPE_INT32: (32, True), FieldDescriptor.TYPE_SINT32: (32, True),
    FieldDescriptor.TYPE_SFIXED32: (32, True), FieldDescriptor.TYPE_INT64: (64, True),
    FieldDescriptor.TYPE_SINT64: (64, True), FieldDescriptor.TYPE_SFIXED64: (64, True),
    FieldDescriptor.TYPE_UINT32: (32, False), FieldDescriptor.TYPE_FIXED32: (32, False),
    FieldDescriptor.TYPE_UINT64: (64, False), FieldDescriptor.TYPE_FIXED64: (64, False),
}  # fmt: skip


def integers(bits: int, signed: bool) -> st.SearchStrategy[int]:
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    edges = [v for v in [*INT_EDGES, low, high, -(10**9)] if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.integers(low, high), st.integers(-3, 70).filter(lambda v: low <= v))


def floats(width: Literal[16, 32, 64]) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(width=width), st.floats(0, 1, width=width))


strings = st.one_of(
    st.sampled_from(STRING_EDGES),
    st.text(alphabet=SEGMENT_CHARS, min_size=1, max_size=140),  # mostly well-formed names, some too long
    st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40),  # protobuf strings hold no surrogates
)


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_BITS:
        return integers(*_INT_BITS[t])
    if t == FieldDescriptor.TYPE_DOUBLE:
        return floats(64)
    if t == FieldDescriptor.TYPE_FLOAT:
        return floats(32)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return strings
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), integers(32, True))
    raise NotImplementedError(f"no strategy for {field.full_name} (type {t})")


def field_values(descriptor: Descriptor) -> dict[str, st.SearchStrategy[Any]]:
    """A strategy per field of ``descriptor``: its hostile values (a list for a repeated field, a dict for a map)."""
    return {f.name: _field_values(f, 0) for f in descriptor.fields}


def with_field(base: Any, name: str, value: Any) -> Any:
    """A copy of message ``base`` with field ``name`` set to ``value`` (as ``field_values`` draws it)."""
    message = type(base)()
    message.CopyFrom(base)
    message.ClearField(name)
    field = base.DESCRIPTOR.fields_by_name[name]
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        getattr(message, name).update(value)
    elif _is_repeated(field):
        getattr(message, name).extend(value)
    elif field.message_type is not None:
        getattr(message, name).CopyFrom(value)
    else:
        setattr(message, name, value)
    return message


def _field_values(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(scalar(key_field), _one(value_field, depth), max_size=MAX_LIST)
    if _is_repeated(field):
        return st.lists(_one(field, depth), max_size=MAX_LIST)
    return _one(field, depth)


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 6.31; `label` is deprecated there
    return bool(repeated) if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _one(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is not None:
        return messages(field.message_type, depth + 1)
    return scalar(field)


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Messages of ``descriptor``'s type with any subset of fields set to hostile values (at most 4 levels deep)."""
    cls = GetMessageClass(descriptor)
    if depth > 4:
        return st.just(cls())
    fields = {f.name: _field_values(f, depth) for f in descriptor.fields}

    @st.composite
    def draw_message(draw: st.DrawFn) -> Any:
        chosen = draw(st.sets(st.sampled_from(sorted(fields)))) if fields else set()
        return cls(**{name: draw(fields[name]) for name in sorted(chosen)})

    return draw_message()


# --- the wire format, written by hand ----------------------------------------------------------------------

WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_I32 = 0, 1, 2, 5


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative numbers go on the wire as 64-bit two's complement
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def record(number: int, wire_type: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire_type) + payload


def _own_wire_type(field: FieldDescriptor) -> int:
    if _is_repeated(field) or field.type in (field.TYPE_STRING, field.TYPE_BYTES, field.TYPE_MESSAGE):
        return WIRE_LEN  # repeated numbers are packed
    if field.type in (field.TYPE_DOUBLE, field.TYPE_FIXED64, field.TYPE_SFIXED64):
        return WIRE_I64
    if field.type in (field.TYPE_FLOAT, field.TYPE_FIXED32, field.TYPE_SFIXED32):
        return WIRE_I32
    return WIRE_VARINT


def wire(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[bytes]:
    """Serialized bytes of ``descriptor``'s type, record by record: each a known field with a payload of its own
    wire type (strings not UTF-8, nested messages garbled in turn) or of another, unknown fields, and cut records."""
    numbers = [f.number for f in descriptor.fields]

    @st.composite
    def one_record(draw: st.DrawFn) -> bytes:
        field = None
        if numbers and draw(st.integers(0, 4)) > 0:  # mostly a known field
            field = descriptor.fields_by_number[draw(st.sampled_from(numbers))]
        number = field.number if field is not None else draw(st.integers(1, (1 << 29) - 1))
        wire_type = draw(st.sampled_from([WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_I32, 3, 4, 6, 7]))
        if field is not None and draw(st.booleans()):  # the field's own wire type, with a payload that may not parse
            wire_type = _own_wire_type(field)
        if wire_type == WIRE_VARINT:
            return record(number, wire_type, varint(draw(st.integers(-(1 << 63), (1 << 64) - 1))))
        if wire_type in (WIRE_I64, WIRE_I32):
            size = 8 if wire_type == WIRE_I64 else 4
            return record(number, wire_type, draw(st.binary(min_size=size, max_size=size)))
        if wire_type != WIRE_LEN:
            return record(number, wire_type, draw(st.binary(max_size=4)))  # groups and reserved types
        if field is not None and field.message_type is not None and depth < 3:
            payload = draw(wire(field.message_type, depth + 1))
        else:
            payload = draw(st.binary(max_size=24) | st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\x80"]))
        declared = len(payload) + draw(st.sampled_from([0, 0, 0, 1, -1, 1 << 20]))
        return record(number, wire_type, varint(max(declared, 0)) + payload)

    return st.lists(one_record(), max_size=6).map(b"".join)
