"""Agent cards: what an A2A client reads before it calls an agent.

A named agent's card says its name and description (from its definition in the agents
bucket, so a changed definition shows at once; the card's ``version`` is the
definition's revision), where it is served (``<base>/a2a/<agent>``, JSON-RPC, protocol
1.0), what it can do (streaming, push notifications) and, unless the gateway runs
without keys, how to authenticate: HTTP ``Bearer`` with a gateway API key. Its one
skill is the agent itself. ``<base>`` is ``[gateway] public_url``, or else the address
the gateway took the request on (its socket's, never the request's ``Host`` header).

Cards are public, as A2A means them to be (a client reads the card to learn how to
authenticate); everything else at ``/a2a/<agent>`` needs a key.
"""

from __future__ import annotations

from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    HTTPAuthSecurityScheme,
    SecurityRequirement,
    SecurityScheme,
    StringList,
)
from a2a.utils.constants import PROTOCOL_VERSION_CURRENT, TransportProtocol

from schemas import AgentSpec

SCHEME = "bearer"
INPUT_MODES = ("text/plain", "application/json", "image/*", "application/octet-stream")
OUTPUT_MODES = ("text/plain",)


def agent_card(agent: AgentSpec, base_url: str, *, keys: bool) -> AgentCard:
    """The card of ``agent`` served under ``base_url``; ``keys``: the gateway wants one."""
    description = agent.description or f"the loopmesh agent {agent.name!r}"
    card = AgentCard(
        name=agent.name,
        description=description,
        version=str(agent.revision),
        supported_interfaces=[
            AgentInterface(
                url=f"{base_url}/a2a/{agent.name}",
                protocol_binding=TransportProtocol.JSONRPC.value,
                protocol_version=PROTOCOL_VERSION_CURRENT,
            )
        ],
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
        default_input_modes=list(INPUT_MODES),
        default_output_modes=list(OUTPUT_MODES),
        skills=[
            AgentSkill(
                id=agent.name,
                name=agent.name,
                description=description,
                tags=["loopmesh", "agent", *(t for t in agent.tools or ())][:16],
            )
        ],
    )
    if keys:
        card.security_schemes[SCHEME].CopyFrom(
            SecurityScheme(
                http_auth_security_scheme=HTTPAuthSecurityScheme(
                    scheme="Bearer",
                    description="a loopmesh gateway API key (`python -m gateway.keys`)",
                )
            )
        )
        card.security_requirements.append(SecurityRequirement(schemes={SCHEME: StringList()}))
    return card


def handler_card() -> AgentCard:
    """The card the SDK's request handler checks capabilities against (streaming, push
    notifications): one handler serves every agent."""
    return AgentCard(
        name="loopmesh",
        description="every loopmesh agent (the card each is served with names it)",
        version="1",
        supported_interfaces=[
            AgentInterface(
                url="/a2a",
                protocol_binding=TransportProtocol.JSONRPC.value,
                protocol_version=PROTOCOL_VERSION_CURRENT,
            )
        ],
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
        default_input_modes=list(INPUT_MODES),
        default_output_modes=list(OUTPUT_MODES),
        skills=[AgentSkill(id="loopmesh", name="loopmesh", description="a loopmesh agent",
                           tags=["loopmesh"])],
    )  # fmt: skip
