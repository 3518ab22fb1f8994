package diagnose

import (
	"encoding/json"
	"fmt"
	"io"
)

// Exit codes of `harvester-csi-driver diagnose`.
const (
	// ExitClean: nothing found but informational findings.
	ExitClean = 0
	// ExitFindings: at least one disagreement.
	ExitFindings = 1
	// ExitCannotLook: the sources could not be read (the command's own).
	ExitCannotLook = 2
)

// Report prints a summary of what was read, the notes, and every finding,
// and returns the exit code: informational findings are printed but do not
// make the look fail, so an operator's script trusts a 0.
func Report(w io.Writer, in Input, findings []Finding) int {
	fmt.Fprintf(w, "host namespace %s: %d VMs, %d VMIs; %d VolumeAttachments of %s; %d VMs in the queue\n",
		in.Namespace, len(in.VMs), len(in.VMIs), countAttachments(in), in.Driver, len(in.Queue))
	if in.QueueSource != "" {
		fmt.Fprintln(w, "queue read from", in.QueueSource)
	}
	for _, n := range in.Notes {
		fmt.Fprintln(w, "note:", n)
	}
	disagreements := 0
	for _, f := range findings {
		fmt.Fprintln(w, f)
		if !f.Info {
			disagreements++
		}
	}
	if disagreements == 0 {
		fmt.Fprintln(w, "no disagreement found")
		return ExitClean
	}
	fmt.Fprintf(w, "%d disagreement(s) found; docs/troubleshooting.md says what each means and what to do\n", disagreements)
	return ExitFindings
}

// Severities of a finding in the JSON report.
const (
	SeverityDisagreement = "disagreement"
	SeverityInfo         = "info"
)

// JSONFinding is one finding of the JSON report.
type JSONFinding struct {
	Kind     string `json:"kind"`
	Severity string `json:"severity"`
	Volume   string `json:"volume,omitempty"`
	VM       string `json:"vm,omitempty"`
	Node     string `json:"node,omitempty"`
	Message  string `json:"message"`
}

// JSONReport is what `diagnose -o json` prints: one object.
type JSONReport struct {
	Namespace         string        `json:"namespace"`
	Driver            string        `json:"driver"`
	VMs               int           `json:"vms"`
	VMIs              int           `json:"vmis"`
	VolumeAttachments int           `json:"volumeAttachments"`
	QueueVMs          int           `json:"queueVMs"`
	QueueSource       string        `json:"queueSource,omitempty"`
	Notes             []string      `json:"notes"`
	Findings          []JSONFinding `json:"findings"`
	Disagreements     int           `json:"disagreements"`
	ExitCode          int           `json:"exitCode"`
}

// ReportJSON prints the same as Report as one JSON object and returns the
// same exit code.
func ReportJSON(w io.Writer, in Input, findings []Finding) int {
	out := JSONReport{Namespace: in.Namespace, Driver: in.Driver, VMs: len(in.VMs), VMIs: len(in.VMIs), VolumeAttachments: countAttachments(in),
		QueueVMs: len(in.Queue), QueueSource: in.QueueSource, Notes: append([]string{}, in.Notes...), Findings: []JSONFinding{}, ExitCode: ExitClean}
	for _, f := range findings {
		sev := SeverityInfo
		if !f.Info {
			sev = SeverityDisagreement
			out.Disagreements++
			out.ExitCode = ExitFindings
		}
		out.Findings = append(out.Findings, JSONFinding{Kind: f.Kind, Severity: sev, Volume: f.Volume, VM: f.VM, Node: f.Node, Message: f.Detail})
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(out); err != nil {
		return ExitCannotLook
	}
	return out.ExitCode
}

func countAttachments(in Input) int {
	n := 0
	for _, va := range in.VolumeAttachments {
		if va.Spec.Attacher == in.Driver {
			n++
		}
	}
	return n
}
