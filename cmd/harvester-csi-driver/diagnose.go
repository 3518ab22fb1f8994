package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/harvester-csi/harvester-csi-driver/pkg/diagnose"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// runDiagnose is `harvester-csi-driver diagnose`: a read-only cross-check of
// the guest's VolumeAttachments, the host's VMs and VMIs and the controller's
// queue. It prints one line per disagreement and exits 1 when there is any,
// 0 when there is none and 2 when it could not look.
func runDiagnose(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("harvester-csi-driver diagnose", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	kubeconfig := fs.String("kubeconfig", "", "host (Harvester) kubeconfig, as for the driver (fallback "+host.DefaultKubeconfig+")")
	guestKubeconfig := fs.String("guest-kubeconfig", "", "guest cluster kubeconfig (default: the in-cluster config when run in a pod; none: guest checks are skipped)")
	controller := fs.String("controller", "", "base URL of the controller's --metrics-address, e.g. http://127.0.0.1:9809, to read its queue (empty: skipped)")
	slowAfter := fs.Duration("slow-after", 2*time.Minute, "report waits and detaching VolumeAttachments older than this")
	timeout := fs.Duration("timeout", 30*time.Second, "give up reading after this long")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stdout, "Usage: harvester-csi-driver diagnose [--kubeconfig F] [--guest-kubeconfig F] [--controller URL] [--slow-after D]")
			fs.SetOutput(stdout)
			fs.PrintDefaults()
			return 0
		}
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: %v\n", err)
		return 2
	}
	path, _, err := host.ResolveKubeconfig(*kubeconfig, host.DefaultKubeconfig)
	if err != nil {
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: --kubeconfig: %v\n", err)
		return 2
	}
	hc, err := host.Load(path, 20, 40)
	if err != nil {
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: %v\n", err)
		return 2
	}
	src := diagnose.Sources{Host: hc, Controller: *controller, Driver: driver.Name}
	notes := []string{}
	switch cfg, err := guestConfig(*guestKubeconfig); {
	case err != nil:
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: --guest-kubeconfig: %v\n", err)
		return 2
	case cfg == nil:
		notes = append(notes, "no guest kubeconfig: VolumeAttachments not checked")
	default:
		if src.Guest, err = kubernetes.NewForConfig(cfg); err != nil {
			fmt.Fprintf(stderr, "harvester-csi-driver diagnose: %v\n", err)
			return 2
		}
	}
	if *controller == "" {
		notes = append(notes, "no --controller: the driver's queue not checked")
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	in, err := diagnose.Gather(ctx, src)
	if err != nil {
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: %v\n", err)
		return 2
	}
	in.SlowAfter = *slowAfter
	findings := diagnose.Check(in)
	fmt.Fprintf(stdout, "host namespace %s: %d VMs, %d VMIs; %d VolumeAttachments of %s; %d VMs in the queue\n",
		hc.Namespace, len(in.VMs), len(in.VMIs), countAttachments(in), driver.Name, len(in.Queue))
	for _, n := range notes {
		fmt.Fprintln(stdout, "note:", n)
	}
	for _, f := range findings {
		fmt.Fprintln(stdout, f)
	}
	if len(findings) == 0 {
		fmt.Fprintln(stdout, "no disagreement found")
		return 0
	}
	fmt.Fprintf(stdout, "%d disagreement(s) found; docs/troubleshooting.md says what each means and what to do\n", len(findings))
	return 1
}

func countAttachments(in diagnose.Input) int {
	n := 0
	for _, va := range in.VolumeAttachments {
		if va.Spec.Attacher == in.Driver {
			n++
		}
	}
	return n
}

// guestConfig is the guest cluster's client config: the given kubeconfig,
// else the in-cluster config, else nil.
func guestConfig(path string) (*rest.Config, error) {
	if path != "" {
		return clientcmd.BuildConfigFromFlags("", path)
	}
	cfg, err := rest.InClusterConfig()
	if errors.Is(err, rest.ErrNotInCluster) {
		return nil, nil
	}
	return cfg, err
}
