"""The Monitor page at `/` (monitor_page.html, plain HTML, SVG and JS: no network beyond this
server): charts of the last minutes from `/v1/status/history`, the placement drawn from
`/v1/status` (one box per device: a rank that runs a stage and hosts a helper tier is one box),
the predicted and measured ms/token side by side, the recent requests, one card per device, all
refreshed once a second. With --api-key, open `/?api_key=K`: the page sends the key to the status
endpoints as a bearer token."""
from pathlib import Path

PAGE = (Path(__file__).with_name("monitor_page.html")).read_text(encoding="utf-8")
