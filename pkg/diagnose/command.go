package diagnose

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// Output formats.
const (
	OutputText = "text"
	OutputJSON = "json"
)

// ControllerNone as Options.Controller skips the driver's queue.
const ControllerNone = "none"

// DefaultNamespace is where the chart is installed by default, and so where
// the controller pods and the attacher's Lease are when diagnose runs
// outside a pod.
const DefaultNamespace = "kube-system"

// Options are the command's flags. Empty strings take the defaults of Env,
// so that in the controller's pod the command needs no flag at all.
type Options struct {
	// Kubeconfig is the host kubeconfig ("": Env.HostKubeconfig), falling
	// back to Env.HostFallback when the file does not exist, as the driver.
	Kubeconfig string
	// GuestKubeconfig is the guest's ("": the in-cluster config).
	GuestKubeconfig string
	// Controller is a metrics base URL to read the queue from, ControllerNone,
	// or "": the replica holding the attacher's Lease, found in the guest.
	Controller string
	// Namespace holds the controller pods and the attacher's Lease ("": the
	// pod's own namespace in a pod, else DefaultNamespace).
	Namespace string
	// ControllerSelector selects the controller pods ("": the chart's).
	ControllerSelector string
	Output             string
	SlowAfter, Timeout time.Duration
	Driver             string
}

// Env is what the command finds in the driver's pod; tests give their own.
type Env struct {
	// HostKubeconfig is where the chart puts the host kubeconfig in the
	// pod, HostFallback where upstream looks when that file is missing.
	HostKubeconfig, HostFallback string
	// InCluster is the pod's guest config; rest.ErrNotInCluster outside a
	// pod.
	InCluster func() (*rest.Config, error)
	// PodNamespace is the pod's namespace, "" when unknown.
	PodNamespace func() string
}

// Run is `harvester-csi-driver diagnose` after its flags: it reads, checks,
// prints the report on stdout and returns the exit code; why it could not
// look goes to stderr.
func Run(ctx context.Context, o Options, env Env, stdout, stderr io.Writer) int {
	fail := func(err error) int {
		fmt.Fprintf(stderr, "harvester-csi-driver diagnose: %v\n", err)
		return ExitCannotLook
	}
	if o.Output != OutputText && o.Output != OutputJSON {
		return fail(fmt.Errorf("-o %q: want %s or %s", o.Output, OutputText, OutputJSON))
	}
	hc, err := loadHost(o.Kubeconfig, env)
	if err != nil {
		return fail(err)
	}
	src := Sources{Host: hc, Driver: o.Driver}
	var notes []string
	cfg, inPod, err := guestConfig(o.GuestKubeconfig, env)
	switch {
	case err != nil:
		return fail(fmt.Errorf("--guest-kubeconfig: %w", err))
	case cfg == nil:
		notes = append(notes, "no guest kubeconfig and not in a pod: the guest side not checked")
	default:
		if src.Guest, err = kubernetes.NewForConfig(cfg); err != nil {
			return fail(err)
		}
	}
	switch {
	case o.Controller == ControllerNone:
		notes = append(notes, "--controller=none: the driver's queue not checked")
	case o.Controller != "":
		src.Controller = o.Controller
	case src.Guest == nil:
		notes = append(notes, "no guest to find the controller replicas in, and no --controller URL: the driver's queue not checked")
	default:
		src.Replicas = &Replicas{Namespace: replicaNamespace(o.Namespace, inPod, env), Selector: o.ControllerSelector}
		if src.Replicas.Selector == "" {
			src.Replicas.Selector = DefaultControllerSelector
		}
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	in, err := Gather(ctx, src)
	if err != nil {
		return fail(err)
	}
	in.SlowAfter = o.SlowAfter
	in.Notes = append(notes, in.Notes...)
	if o.Output == OutputJSON {
		return ReportJSON(stdout, in, Check(in))
	}
	return Report(stdout, in, Check(in))
}

// loadHost loads the host kubeconfig the way the driver in the chart's pod
// does: the given file, else the chart's, falling back to upstream's path
// when that file does not exist.
func loadHost(given string, env Env) (*host.Client, error) {
	want := given
	if want == "" {
		want = env.HostKubeconfig
	}
	path, _, err := host.ResolveKubeconfig(want, env.HostFallback)
	if err != nil {
		return nil, err
	}
	return host.Load(path, 20, 40)
}

// guestConfig is the given guest kubeconfig, else the pod's in-cluster
// config (inPod), else nil.
func guestConfig(path string, env Env) (cfg *rest.Config, inPod bool, err error) {
	if path != "" {
		cfg, err := clientcmd.BuildConfigFromFlags("", path)
		return cfg, false, err
	}
	if env.InCluster == nil {
		return nil, false, nil
	}
	cfg, err = env.InCluster()
	if errors.Is(err, rest.ErrNotInCluster) {
		return nil, false, nil
	}
	return cfg, err == nil, err
}

func replicaNamespace(given string, inPod bool, env Env) string {
	switch {
	case given != "":
		return given
	case inPod && env.PodNamespace != nil && env.PodNamespace() != "":
		return env.PodNamespace()
	}
	return DefaultNamespace
}
