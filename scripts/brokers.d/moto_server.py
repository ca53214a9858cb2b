"""The moto server (the local SQS endpoint), with one cost of its ReceiveMessage removed.

moto checks each message it returns against the queue's retention period by calling
get_queue_attributes, which computes every attribute of the queue, among them
ApproximateNumberOfMessages and ApproximateNumberOfMessagesNotVisible (each a pass over
all of the queue's messages). A receive of 10 from a queue holding 1,500 messages then
costs ~0.75 s of the interpreter lock, and every other request to the server waits
behind it (measured with moto 5.2.1; 5.2.6 has the same code). The replacement below
reads the retention period from the queue itself: the same answer, the same expiry
behaviour, without the passes over the queue.

If a moto release changes these names, the server starts unpatched and says so.
"""

import sys

from moto.core.utils import unix_time
from moto.server import main
from moto.sqs.models import SQSBackend


def _patch_retention_check() -> None:
    original = getattr(SQSBackend, "is_message_valid_based_on_retention_period", None)
    if original is None:
        print("moto_server.py: no retention check to patch; moto runs as released",
              file=sys.stderr)
        return

    def is_message_valid_based_on_retention_period(self, queue_name, message):
        queue = self.get_queue(queue_name)
        retention = getattr(queue, "message_retention_period", None)
        if retention is None:
            return original(self, queue_name, message)
        return int(retention) + message.sent_timestamp / 1000 > unix_time()

    SQSBackend.is_message_valid_based_on_retention_period = (
        is_message_valid_based_on_retention_period
    )


if __name__ == "__main__":
    _patch_retention_check()
    sys.exit(main())
