package main

import (
	"fmt"
	"strconv"

	logsapi "k8s.io/component-base/logs/api/v1"
	// The JSON format of Kubernetes' components, registered for
	// --logging-format=json.
	_ "k8s.io/component-base/logs/json/register"
)

// Log formats of --logging-format: klog's text, or the JSON lines every
// Kubernetes component writes with --logging-format=json.
const (
	logFormatText = logsapi.DefaultLogFormat
	logFormatJSON = logsapi.JSONLogFormat
)

func validLogFormat(f string) error {
	if f != logFormatText && f != logFormatJSON {
		return fmt.Errorf("invalid --logging-format %q: want %s or %s", f, logFormatText, logFormatJSON)
	}
	return nil
}

// applyLogging switches the process's logger to the format asked for,
// keeping the verbosity --v (or --debug) set. Kubernetes' logging setup is
// process-wide and taken once, so only main calls it.
func applyLogging(format, verbosity string) error {
	v, err := strconv.ParseUint(verbosity, 10, 32)
	if err != nil {
		return fmt.Errorf("log verbosity %q: %w", verbosity, err)
	}
	c := logsapi.NewLoggingConfiguration()
	c.Format = format
	c.Verbosity = logsapi.VerbosityLevel(v)
	return logsapi.ValidateAndApply(c, nil)
}
