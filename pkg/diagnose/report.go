package diagnose

import (
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

func countAttachments(in Input) int {
	n := 0
	for _, va := range in.VolumeAttachments {
		if va.Spec.Attacher == in.Driver {
			n++
		}
	}
	return n
}
