"""roundalign inside other projects' trainers: one module per framework (``trl``, ``verl``), each a call that makes
that framework's own trainer round and score where its inference engine does. Import the module you use; this
package imports nothing itself, so that one framework's absence never breaks another's integration."""
