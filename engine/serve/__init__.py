"""`eddy serve`: the OpenAI-compatible local server over the same engine the app and `eddy chat` use.

protocol.py parses and checks requests and shapes errors; conversations.py matches each request against the
conversations whose caches it keeps (snapshot/restore of the cache globals), so only new tokens are
prefilled; worker.py is the one engine thread requests queue on; app.py is the Starlette application.
"""
