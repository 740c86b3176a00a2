"""The HTTP face of the service: one `APIRouter` per resource, composed by `metaagent.app.create_app`.

tools        POST /tools/<name> (one route per catalogue entry), GET /tools
executions   GET /executions, GET/DELETE /executions/{id}
health       GET /health, GET /metrics
body         the route class of every router: JSON bodies read strictly (metaagent.request_json)
errors       the error tree mapped to JSON responses, and the OpenAPI shape of an error
"""
