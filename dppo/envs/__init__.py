"""Environment libraries as dppo agents: what a user's agent file (rollout.agent.path) imports to run another
library's environments through the rollout worker's agent endpoint (dppo.workers.rollout.agent).

    verifiers_env.py  verifiers' classic environments (MultiTurnEnv, ToolEnv, an installed environment package):
                      verifiers_agent(env) -> the agent function (the envs extra: pip install 'dppo[envs]')

The package imports none of its modules, and they import their library only when an agent is made: importing dppo
needs none of them.
"""
