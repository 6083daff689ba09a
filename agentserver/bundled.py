"""A copy of the repository's ``boot.xml``, so ``agentserver run`` has a topology to run
when installed from a wheel and started outside a checkout. ``tests/test_boot_bundled.py``
keeps it identical to the file at the repository root (copy the file here when it changes).
"""

BOOT_XML = """<?xml version="1.0" encoding="UTF-8"?>
<!--
  The bundled topology. Reference: docs/boot.md; grammar: schemas/boot.xsd.
  No <clients> are declared, so connections are anonymous and the server listens on
  loopback only (agentserver run refuses a public address unless given its insecure option).
-->
<organism xmlns="https://xml-pipeline.org/ns/boot/v1" name="hello">
  <description>Echo, a calculator, the console and the assistant agent.</description>

  <listen host="127.0.0.1" port="7340"/>

  <limits max-connections="256" max-inflight="64" outgoing-buffer="256"
          max-message-bytes="1048576" read-timeout="10" drain-timeout="5"/>

  <listeners>
    <!-- Receives the boot primitive on the root thread; starts an attached console. -->
    <listener name="boot" handler="system-boot" peers="console"/>

    <!-- A built-in: its payload types come with it. -->
    <listener name="echo" handler="echo">
      <description>Answers ping with pong.</description>
    </listener>

    <!-- The same kind of listener spelled out with import paths. -->
    <listener name="calculator" handler="agentserver.listeners.calculator:handle"
              concurrency="8" timeout="5">
      <description>Integer arithmetic.</description>
      <accepts type="agentserver.listeners.calculator:Add"/>
      <accepts type="agentserver.listeners.calculator:Subtract"/>
      <accepts type="agentserver.listeners.calculator:Multiply"/>
      <accepts type="agentserver.listeners.calculator:Divide"/>
      <responds type="calculator.sum"/>
      <responds type="calculator.difference"/>
      <responds type="calculator.product"/>
      <responds type="calculator.quotient"/>
    </listener>

    <!-- The default agent of the console. Until an agent runtime is configured it
         answers every task with a notice saying so. -->
    <listener name="assistant" handler="assistant" agent="true" peers="calculator"
              timeout="300">
      <description>General assistant; may use the calculator.</description>
    </listener>

    <!-- The console: "agentserver run" with its console option in the server's terminal,
         or "agentserver console" from another terminal over the socket. -->
    <listener name="console" handler="console" peers="console-router"/>
    <listener name="console-router" handler="console-router"
              peers="echo calculator assistant"/>
  </listeners>
</organism>
"""
