"""A report as it arrives: its bytes, and the little of it the daemon reads before the report process takes them.

A ReportRounds request at the size bound is 1 MiB. Parsing all of it into a ``ReportRoundsRequest`` takes 1.2 ms, on
the event loop's thread (gRPC deserializes there, in the coroutine that reads the request), which every Decide runs
in; handing it to the report process would then serialize it again, 1.5 ms in a pool thread holding the interpreter.
Yet before the child takes over, the daemon needs three things only: how many aggregates there are (the
report budget is charged by them), the (segment, batch size) pairs (the step times the child reads realised
speedups at), and the report id. ``ReportHead`` is a message with just those fields, at the same field numbers, so
protobuf walks past the rest without building it: 0.19 ms for the same 1 MiB. The child parses the whole bytes
(``ReceivedReport.data``), as does the daemon when the report stays with it (``ReceivedReport.message``).

Bytes the head does not parse (a field cut short, a segment or report id that is not UTF-8) are refused by
``serving/unparsable.py`` as any request is; bytes whose head parses but whose whole message does not (a drafter
name that is not UTF-8) are refused where the whole message is parsed, with the same INVALID_ARGUMENT words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from specd_api.v1 import controller_pb2 as pb

METHOD = "/specd.v1.Controller/ReportRounds"


def _head_class() -> Any:
    """The ReportHead message class, built from ReportRoundsRequest's own descriptor: its field numbers and types
    cannot drift from the wire contract's."""
    request, aggregate = pb.ReportRoundsRequest.DESCRIPTOR, pb.RoundsAggregate.DESCRIPTOR
    source = descriptor_pb2.FileDescriptorProto()
    request.file.CopyToProto(source)
    package = source.package  # in a pool of its own: protobuf's parse errors name the request's own type
    head_file = descriptor_pb2.FileDescriptorProto(name="specd_report_head.proto", package=package, syntax="proto3")
    kept = {aggregate.name: ("segment", "batch_size", "temperature", "start_up_timings"),
            request.name: ("report_id", "aggregates")}  # fmt: skip
    for message in source.message_type:
        if message.name not in kept:
            continue
        head = head_file.message_type.add(name=message.name)
        for field in message.field:
            if field.name in kept[message.name]:
                head.field.add().CopyFrom(field)  # the aggregates' type names this file's RoundsAggregate: same package
    pool = descriptor_pool.DescriptorPool()
    pool.Add(head_file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{request.name}"))


ReportHead = _head_class()


@dataclass(frozen=True, eq=False)
class ReceivedReport:
    """A ReportRounds request's bytes and its head (``report_id``, and each aggregate's ``segment``, ``batch_size``,
    ``temperature`` and ``start_up_timings``): what gRPC hands the servicer for ReportRounds (``parse`` is the method's
    deserializer)."""

    data: bytes
    head: Any  # a ReportHead

    @classmethod
    def parse(cls, data: bytes) -> ReceivedReport:
        """Raises DecodeError for bytes whose head does not parse."""
        return cls(data, ReportHead.FromString(data))

    @classmethod
    def of(cls, request: pb.ReportRoundsRequest) -> ReceivedReport:
        """A request built in this process, as if it had come over the wire."""
        return cls.parse(request.SerializeToString())

    def message(self) -> pb.ReportRoundsRequest:
        """The whole request; raises DecodeError for bytes that do not parse as one."""
        return pb.ReportRoundsRequest.FromString(self.data)
