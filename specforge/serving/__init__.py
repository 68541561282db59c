"""`specforge serve`: the embedded engine behind an HTTP server that speaks SGLang's protocol.

Only the HTTP app lives here; launching servers as processes is specforge/launch/, and the serving
benchmark that measures them is specforge/eval/ (bench_client, scenarios, server_eval).
"""
