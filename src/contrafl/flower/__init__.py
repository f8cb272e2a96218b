"""Run contrafl's algorithms on the Flower runtime (ServerApp/ClientApp).

Importing this package does not import ``flwr``; its modules need the ``flower`` extra
(``pip install "contrafl[flower]"``) and say so with a clear ImportError
(:func:`contrafl.flower.codec.require_flwr`).
"""
