"""ClientApp: reply with the arrays of the message, untouched (no training)."""

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Send the message's arrays back."""
    return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)
