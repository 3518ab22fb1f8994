package diagnose

import (
	"context"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// DefaultControllerSelector selects the controller Deployment's pods as the
// chart labels them (charts/harvester-csi-driver/templates/_helpers.tpl,
// hcsi.controllerSelectorLabels, without the release's instance label).
const DefaultControllerSelector = "component=csi-controllers,app.kubernetes.io/name=harvester-csi-driver"

// MetricsPortName is the name the chart gives the driver container's
// --metrics-address port, where StatePath is served.
const MetricsPortName = "metrics"

// Replicas says where the controller's replicas are in the guest cluster.
// Only the replica whose external-attacher is the leader is sent
// ControllerPublish/Unpublish (the attacher talks to the driver in its own
// pod), so its queue is the one that matters; the others are idle unless
// their guest node monitor is elected.
type Replicas struct {
	// Namespace holds the controller pods and the attacher's Lease (the
	// chart passes the pod's namespace as --leader-election-namespace).
	Namespace string
	// Selector selects the controller pods, for reading all of them when
	// the Lease does not name a readable one.
	Selector string
}

// AttacherLeaseName is the Lease the external-attacher elects its leader
// on: "external-attacher-leader-" + the driver name, with every character
// other than letters, digits and '-' replaced by '-' (external-attacher
// v4.12.0 cmd/csi-attacher/main.go; csi-lib-utils v0.24.0
// leaderelection/leader_election.go, sanitizeName). The holder identity is
// the holder's host name, i.e. its pod's name, sanitized the same way.
func AttacherLeaseName(driver string) string {
	return sanitizeLeaseName("external-attacher-leader-" + driver)
}

var notLeaseChar = regexp.MustCompile("[^a-zA-Z0-9-]")

func sanitizeLeaseName(name string) string {
	name = notLeaseChar.ReplaceAllString(name, "-")
	if strings.HasSuffix(name, "-") {
		name += "X"
	}
	return name
}

// stateReader reads one replica's queue state from its metrics address.
type stateReader func(ctx context.Context, base string) ([]hotplug.VMState, error)

// replicaQueue reads the queue of the replica that holds the attacher's
// Lease; when the Lease, its holder's pod or that pod's state cannot be
// read, it reads every controller pod and merges what they answer. It never
// fails: what it could not read it says in notes, and source says which
// replicas were read.
func replicaQueue(ctx context.Context, guest kubernetes.Interface, r Replicas, driver string, read stateReader) (states []hotplug.VMState, source string, notes []string) {
	logger := klog.FromContext(ctx)
	lease := r.Namespace + "/" + AttacherLeaseName(driver)
	pod, why := leaseHolder(ctx, guest, r.Namespace, AttacherLeaseName(driver))
	if pod != nil {
		st, err := readPod(ctx, pod, read)
		if err == nil {
			return st, fmt.Sprintf("replica %s (holder of Lease %s)", pod.Name, lease), nil
		}
		why = err.Error()
	}
	logger.V(2).Info("Reading every controller replica", "lease", lease, "reason", why)
	notes = append(notes, fmt.Sprintf("the leader of Lease %s could not be read (%s): every controller replica's queue merged", lease, why))
	pods, err := guest.CoreV1().Pods(r.Namespace).List(ctx, metav1.ListOptions{LabelSelector: r.Selector})
	if err != nil {
		return nil, "", append(notes, fmt.Sprintf("controller pods (%s in %s) not listed (%v): the driver's queue not checked", r.Selector, r.Namespace, err))
	}
	var readNames []string
	for i := range pods.Items {
		p := &pods.Items[i]
		st, err := readPod(ctx, p, read)
		if err != nil {
			notes = append(notes, err.Error())
			continue
		}
		states = append(states, st...)
		readNames = append(readNames, p.Name)
	}
	if len(readNames) == 0 {
		return nil, "", append(notes, fmt.Sprintf("no controller replica (%s in %s) could be read: the driver's queue not checked", r.Selector, r.Namespace))
	}
	slices.Sort(readNames)
	return states, "replicas " + strings.Join(readNames, ", ") + " merged", notes
}

// leaseHolder is the pod named by the Lease's holder, or why there is none.
func leaseHolder(ctx context.Context, guest kubernetes.Interface, ns, name string) (*corev1.Pod, string) {
	l, err := guest.CoordinationV1().Leases(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err.Error()
	}
	if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" {
		return nil, "it has no holder"
	}
	pod, err := guest.CoreV1().Pods(ns).Get(ctx, *l.Spec.HolderIdentity, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Sprintf("its holder %s: %v", *l.Spec.HolderIdentity, err)
	}
	return pod, ""
}

// readPod reads the queue state a controller pod serves on its metrics
// port, at its pod IP.
func readPod(ctx context.Context, p *corev1.Pod, read stateReader) ([]hotplug.VMState, error) {
	base, err := podStateURL(p)
	if err != nil {
		return nil, fmt.Errorf("replica %s: %w", p.Name, err)
	}
	st, err := read(ctx, base)
	if err != nil {
		return nil, fmt.Errorf("replica %s: %w", p.Name, err)
	}
	return st, nil
}

func podStateURL(p *corev1.Pod) (string, error) {
	if p.Status.PodIP == "" {
		return "", fmt.Errorf("no pod IP (phase %s)", p.Status.Phase)
	}
	for _, c := range p.Spec.Containers {
		for _, port := range c.Ports {
			if port.Name == MetricsPortName {
				return "http://" + net.JoinHostPort(p.Status.PodIP, strconv.Itoa(int(port.ContainerPort))), nil
			}
		}
	}
	return "", fmt.Errorf("no container port named %q (the chart's metrics.enabled=false: no queue state is served)", MetricsPortName)
}
