"""Sessions: a stateful code interpreter, one long-lived container per session, with a workspace.

models     the request and answer models (one source for validation, OpenAPI, tool schemas)
paths      the workspace path rules of the file calls
service    the sessions of this service: create, calls and file requests in order, idle and
           lifetime deadlines, ended sessions answered with 410, per-key limits, audit
"""
