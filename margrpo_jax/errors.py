"""The one base of every mistake a user can make: the entry point prints it as one ``error: ...`` line and exits
with code 2 (``main.user_errors``). Each module's own error (a bad config value, checkpoint, prompt file, path,
family or a busy workdir) derives from :class:`UserError` and from the built-in it is a case of (``ValueError``...),
so callers that catch the built-in keep working."""


class UserError(Exception):
  """A user's mistake, its message one sentence naming the key, file or value."""
