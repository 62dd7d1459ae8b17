#!/usr/bin/env python3
"""TensorBoard's own view of our event files, for tests/trainer/test_tensorboard.cpp and
TrainerRun.TensorBoard: reads every events.out.tfevents.* file in DIR and prints one JSON object

    {"files": [names], "file_version": "brain.Event:2",
     "records": [{"file": name, "step": s, "wall_time": t, "kind": "file_version" |
                  "session_start" | "scalars", "values": {tag: value}}],
     "scalars": {tag: [[step, value], ...]}}

"records" come from TensorBoard's record reader (tensorboard.compat.tensorflow_stub's
PyRecordReader, which checks both masked CRC-32Cs of every record) and its protobuf Event
message; "scalars" from its EventAccumulator, as the TensorBoard UI would show them (after
SessionLog.START purges). A record that fails its CRC check, or a file that ends inside a
record, exits with status 1 and the reader's message: EventAccumulator's loader would silently
stop at such a record instead, so it cannot be the check for corruption.

    check_tensorboard.py DIR
"""
import json
import logging
import math
import os
import sys

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow


def number(v):
    # JSON has no NaN or infinity: strings the C++ side reads back with std::stod.
    return v if math.isfinite(v) else repr(v)


def read_records(path):
    reader = pywrap_tensorflow.PyRecordReader_New(path.encode())
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return
        yield reader.record()


def main():
    # EventAccumulator logs a warning when a SessionLog START purges steps, which is what a
    # resumed run's file is for; stdout must hold only the JSON.
    logging.getLogger("tensorboard").setLevel(logging.ERROR)
    directory = sys.argv[1]
    files = sorted(f for f in os.listdir(directory) if "tfevents" in f)
    out = {"files": files, "records": [], "scalars": {}}
    for name in files:
        try:
            for data in read_records(os.path.join(directory, name)):
                event = event_pb2.Event.FromString(data)
                kind = event.WhichOneof("what")
                record = {"file": name, "step": event.step, "wall_time": event.wall_time}
                if kind == "file_version":
                    record["kind"] = "file_version"
                    out["file_version"] = event.file_version
                elif kind == "session_log":
                    assert event.session_log.status == event_pb2.SessionLog.START, event
                    record["kind"] = "session_start"
                elif kind == "summary":
                    record["kind"] = "scalars"
                    record["values"] = {}
                    for v in event.summary.value:
                        assert v.WhichOneof("value") == "simple_value", v
                        record["values"][v.tag] = number(v.simple_value)
                else:
                    raise AssertionError(f"{name}: unexpected event {event}")
                out["records"].append(record)
        except (errors.DataLossError, errors.OutOfRangeError) as e:
            print(f"{name}: {e.message}")
            sys.exit(1)
    acc = event_accumulator.EventAccumulator(directory,
                                             size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        out["scalars"][tag] = [[s.step, number(s.value)] for s in acc.Scalars(tag)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
