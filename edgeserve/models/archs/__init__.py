"""One package per architecture family, found through edgeserve.models.registry (imported on use): `__init__.py`
declares (tensor names, flags), `config.py` reads its own config fields, `model.py` names the decoder that runs it."""
