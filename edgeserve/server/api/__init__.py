"""The APIs the server speaks, one adapter each: parse the body into a GenerationRequest, hand it to the pipeline
(edgeserve/server/respond.py), shape its events as the API's reply."""
