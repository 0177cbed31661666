"""An OpenAI-compatible gateway: existing agents call the policy through it while they train.

`gateway.server.Gateway` serves OpenAI's chat and completion endpoints on 127.0.0.1, one session
(base URL and key) per rollout; `gateway.session.AgentSession` records each call's exact tokens
as a `Step`; `gateway.api` is the wire format. `workflows.agent.AgentWorkflow` puts it together.
"""
