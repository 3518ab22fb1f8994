package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"k8s.io/client-go/rest"

	"github.com/harvester-csi/harvester-csi-driver/pkg/diagnose"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// chartKubeconfig is where the chart's controller and node pods have the
// host kubeconfig (charts/harvester-csi-driver/templates/_helpers.tpl,
// hcsi.cloudConfigFile), the path the chart passes the driver as
// --kubeconfig.
const chartKubeconfig = "/var/lib/harvester/cloud-provider-config"

// serviceAccountNamespace is the file in which Kubernetes tells a pod its
// namespace.
const serviceAccountNamespace = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// podEnv is what diagnose finds in the chart's controller pod.
func podEnv() diagnose.Env {
	return diagnose.Env{HostKubeconfig: chartKubeconfig, HostFallback: host.DefaultKubeconfig, InCluster: rest.InClusterConfig,
		PodNamespace: func() string {
			b, err := os.ReadFile(serviceAccountNamespace)
			if err != nil {
				return ""
			}
			return strings.TrimSpace(string(b))
		}}
}

// runDiagnose is `harvester-csi-driver diagnose`: a read-only cross-check of
// the guest's VolumeAttachments, PVs, Nodes and CSINodes, the host's VMs,
// VMIs, PVCs and attachment pods, and the controller's queue. It prints one
// line per finding (or one JSON object with -o json) and exits 1 when there
// is any disagreement, 0 when there is none (informational findings do not
// count) and 2 when it could not look.
func runDiagnose(ctx context.Context, args []string, env diagnose.Env, stdout, stderr io.Writer) int {
	o := diagnose.Options{Driver: driver.Name}
	fs := newDiagnoseFlagSet(&o, env)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printDiagnoseUsage(stdout, fs)
			return diagnose.ExitClean
		}
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: %v\nRun 'harvester-csi-driver diagnose --help' for the list of flags.\n", err)
		return diagnose.ExitCannotLook
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: unexpected arguments: %v\n", fs.Args())
		return diagnose.ExitCannotLook
	}
	return diagnose.Run(ctx, o, env, stdout, stderr)
}

func newDiagnoseFlagSet(o *diagnose.Options, env diagnose.Env) *flag.FlagSet {
	fs := flag.NewFlagSet("harvester-csi-driver diagnose", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&o.Kubeconfig, "kubeconfig", "", "host (Harvester) kubeconfig (default: "+env.HostKubeconfig+", the chart's, then "+env.HostFallback+", as the driver)")
	fs.StringVar(&o.GuestKubeconfig, "guest-kubeconfig", "", "guest cluster kubeconfig (default: the in-cluster config when run in a pod; else the guest side is not checked)")
	fs.StringVar(&o.Controller, "controller", "", "base URL of one controller's --metrics-address (e.g. http://127.0.0.1:9809) to read its queue at "+
		diagnose.StatePath+"; "+diagnose.ControllerNone+": skip the queue (default: the replica whose external-attacher holds the leader Lease "+
		diagnose.AttacherLeaseName(driver.Name)+", found through the guest API; every replica merged when it cannot be read)")
	fs.StringVar(&o.Namespace, "namespace", "", "guest namespace of the controller pods and the attacher's Lease (default: the pod's own in a pod, else "+diagnose.DefaultNamespace+")")
	fs.StringVar(&o.ControllerSelector, "controller-selector", diagnose.DefaultControllerSelector, "label selector of the controller pods")
	fs.StringVar(&o.Output, "o", diagnose.OutputText, "output: text or json")
	fs.StringVar(&o.Output, "output", diagnose.OutputText, "output: text or json (the same as -o)")
	fs.DurationVar(&o.SlowAfter, "slow-after", 2*time.Minute, "report waits, detaching VolumeAttachments, Pending host PVCs and Pending attachment pods older than this")
	fs.DurationVar(&o.Timeout, "timeout", 30*time.Second, "give up reading after this long")
	return fs
}

// printDiagnoseUsage lists the flags as they are written (--name), what is
// checked and the exit codes.
func printDiagnoseUsage(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprint(w, `Usage: harvester-csi-driver diagnose [flags]

Read-only cross-check of the guest cluster (VolumeAttachments, PVs, Nodes, CSINodes), the host namespace (VMs, VMIs,
PVCs, NetworkFilesystems, attachment pods) and the driver's hotplug queue. In the controller pod it needs no flag:
  kubectl -n kube-system exec deploy/harvester-csi-driver-controllers -c harvester-csi-driver -- harvester-csi-driver diagnose
Each finding's kind and what to do: docs/troubleshooting.md, "diagnose findings".

Flags:
`)
	fs.VisitAll(func(f *flag.Flag) {
		kind, usage := flag.UnquoteUsage(f)
		line := "  --" + f.Name
		if len(f.Name) == 1 {
			line = "  -" + f.Name
		}
		if kind != "" {
			line += " " + kind
		}
		if f.DefValue != "" {
			usage += fmt.Sprintf(" (default %s)", f.DefValue)
		}
		fmt.Fprintf(w, "%s\n      %s\n", line, usage)
	})
	fmt.Fprintf(w, `
Exit codes:
  %d  no disagreement (informational findings and notes may be printed)
  %d  at least one disagreement
  %d  could not look (a flag, a kubeconfig, or a read of the host, the guest or a --controller URL failed; the reason is on stderr)
`, diagnose.ExitClean, diagnose.ExitFindings, diagnose.ExitCannotLook)
}
