"""ClientApp: reply with the node's partition id, a per-run counter kept in
``context.state``, the node's ``label`` and the server's message."""

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Count the train messages of this run and echo what identifies the node."""
    state = context.state
    counter = int(state["echo"]["counter"]) + 1 if "echo" in state else 1
    state["echo"] = ConfigRecord({"counter": counter})
    metrics = MetricRecord({
        "partition-id": int(context.node_config["partition-id"]),
        "num-partitions": int(context.node_config["num-partitions"]),
        "counter": counter,
    })
    echo = ConfigRecord({
        "label": str(context.node_config.get("label", "")),
        "message": str(msg.content["config"]["message"]),
    })
    return Message(RecordDict({"metrics": metrics, "echo": echo}), reply_to=msg)
