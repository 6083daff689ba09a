"""Remote listeners: the hub that hands deliveries to runner connections as jobs
(:mod:`.hub`), and ``agentserver runner``, the process that serves them (:mod:`.runner`)."""
