"""What the tests and the scripts (benchmarks, chaos, demos) share, so neither imports the other:
daemons started on localhost (`local_daemons`) or on hosts of their own in network namespaces
(`netns_hosts`), calls and checks against them (`helpers`), the answers they must give
(`reference`: the in-process engine's and transformers' greedy tokens), checks of the in-process
engine (`engine_checks`), an OpenAI front's client (`openai_front`), TLS certificates
(`certificates`) and a tiny sliding-window model (`tiny_mistral`)."""
