package kubevirt

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// Backend names accepted by --hotplug-backend.
const (
	BackendAuto        = "auto"
	BackendDeclarative = "declarative"
	BackendSubresource = "subresource"
)

// settingResource is Harvester's settings (server-version here).
var settingResource = schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "settings"}

// Backend is the hotplug backend --hotplug-backend asks for: the
// declarative or the subresource path, or, for "auto", whichever the host's
// KubeVirt expects. Detection is part of the backend so that the queue can
// be built before the host answers: Start learns the path, and until it has,
// the queue does not run and answers "not ready".
type Backend struct {
	c      *host.Client
	choice string
	vms    cache.Store
	// path is the backend in use once known; Start sets it before the
	// queue's workers (the only callers of Apply) start.
	path atomic.Pointer[writer]
	// version is the KubeVirt CR's status.observedKubeVirtVersion as Start
	// read it; empty when the CR could not be read.
	version atomic.Pointer[string]
}

// writer is one hotplug path: Declarative or Subresource.
type writer interface {
	Name() string
	Apply(ctx context.Context, vm string, changes []hotplug.Change) []hotplug.Outcome
}

// NewBackend checks choice and returns its backend; it does no I/O. vms is
// the VM informer's store, which the declarative path reads to skip a read
// of a VM its own last patch left unchanged.
func NewBackend(c *host.Client, choice string, vms cache.Store) (*Backend, error) {
	b := &Backend{c: c, choice: choice, vms: vms}
	switch choice {
	case BackendDeclarative, BackendSubresource:
		b.use(choice)
	case BackendAuto, "":
	default:
		return nil, fmt.Errorf("unknown hotplug backend %q (want auto, declarative or subresource)", choice)
	}
	return b, nil
}

func (b *Backend) use(name string) {
	var path writer = NewSubresource(b.c)
	if name == BackendDeclarative {
		path = NewDeclarative(b.c, b.vms)
	}
	b.path.Store(&path)
}

// Start implements hotplug.Backend: for "auto" it asks the host which path
// its KubeVirt expects. Detection never guesses: while the host API does not
// answer it asks again (every retryMax at most) until it does or ctx ends,
// and progress reports each failed attempt.
func (b *Backend) Start(ctx context.Context, progress func(reason string)) error {
	defer b.readKubeVirt(ctx)
	if b.path.Load() != nil {
		return nil
	}
	logger := klog.FromContext(ctx)
	detect := func() (string, string) {
		// A host API that hangs must not hang detection.
		dctx, cancel := context.WithTimeout(ctx, detectTimeout)
		defer cancel()
		return DetectBackend(dctx, b.c)
	}
	name, why := detect()
	for delay := time.Second; name == ""; delay = min(2*delay, retryMax) {
		logger.Info("host API unreachable, hotplug backend not detected yet; retrying", "reason", why, "in", delay)
		progress(why)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		name, why = detect()
	}
	logger.Info("hotplug backend detected", "backend", name, "reason", why)
	b.use(name)
	return nil
}

// KubeVirtVersion is the host's KubeVirt release as its CR reports it, once
// Start returned; empty when the CR cannot be read (the read is optional:
// docs/host-rbac.md). The queue picks its strategy per release from it.
func (b *Backend) KubeVirtVersion() string {
	if v := b.version.Load(); v != nil {
		return *v
	}
	return ""
}

// readKubeVirt reads the KubeVirt CR, best effort: without it the queue
// keeps the strategy safe for every release and the subresource path makes
// one virt-api call per change, so a refusal or a timeout is only logged.
func (b *Backend) readKubeVirt(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, detectTimeout)
	defer cancel()
	kv, err := kubeVirtCR(rctx, b.c)
	v := ""
	if err != nil {
		klog.FromContext(ctx).V(2).Info("KubeVirt CR unreadable: the hotplug queue keeps the strategy safe for every release", "err", err)
	} else {
		v = kv.Status.ObservedKubeVirtVersion
	}
	b.version.Store(&v)
	if p := b.path.Load(); p != nil && kv != nil {
		if sub, ok := (*p).(*Subresource); ok {
			if legacy, _ := hotplugGates(kv); legacy {
				sub.UseRequestList()
			}
		}
	}
}

// ObservedKubeVirtVersion reads the version the KubeVirt CR reports as
// deployed (status.observedKubeVirtVersion).
func ObservedKubeVirtVersion(ctx context.Context, c *host.Client) (string, error) {
	kv, err := kubeVirtCR(ctx, c)
	if err != nil {
		return "", err
	}
	return kv.Status.ObservedKubeVirtVersion, nil
}

func kubeVirtCR(ctx context.Context, c *host.Client) (*kubevirtv1.KubeVirt, error) {
	kvs, err := c.KubeVirt.KubevirtV1().KubeVirts("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	if len(kvs.Items) == 0 {
		return nil, errors.New("no KubeVirt CR")
	}
	return &kvs.Items[0], nil
}

// Name implements hotplug.Backend; it is empty until the path is known.
func (b *Backend) Name() string {
	if p := b.path.Load(); p != nil {
		return (*p).Name()
	}
	return ""
}

// Apply implements hotplug.Backend; the queue calls it only after Start.
func (b *Backend) Apply(ctx context.Context, vm string, changes []hotplug.Change) []hotplug.Outcome {
	return (*b.path.Load()).Apply(ctx, vm, changes)
}

// Refusal implements hotplug.Backend.
func (b *Backend) Refusal(vm *kubevirtv1.VirtualMachine, volume string) error {
	return Refusal(vm, volume)
}

const (
	// retryMax bounds the wait between two backend detection attempts.
	retryMax = 30 * time.Second
	// detectTimeout bounds one detection attempt.
	detectTimeout = 10 * time.Second
)

// DetectBackend picks the backend the host's KubeVirt expects: declarative
// when the KubeVirt CR enables DeclarativeHotplugVolumes without the legacy
// HotplugVolumes gate (the legacy gate wins when both are on), or, when the
// CR cannot be read, when Harvester's server-version is v1.8 or later.
// Anything unknown falls back to the subresource path, which every KubeVirt
// with hotplug serves; an empty name means the API server did not answer.
func DetectBackend(ctx context.Context, c *host.Client) (name, reason string) {
	kvs, err := c.KubeVirt.KubevirtV1().KubeVirts("").List(ctx, metav1.ListOptions{})
	if err == nil && len(kvs.Items) > 0 {
		legacy, declarative := hotplugGates(&kvs.Items[0])
		switch {
		case legacy:
			return BackendSubresource, "KubeVirt CR enables HotplugVolumes"
		case declarative:
			return BackendDeclarative, "KubeVirt CR enables DeclarativeHotplugVolumes only"
		}
	}
	setting, serr := c.Dynamic.Resource(settingResource).Get(ctx, "server-version", metav1.GetOptions{})
	if serr != nil {
		why := fmt.Sprintf("no KubeVirt CR readable (%v) and no server-version setting (%v)", err, serr)
		var status apierrors.APIStatus
		if !errors.As(serr, &status) {
			return "", why // no answer from the API server at all
		}
		return BackendSubresource, why
	}
	value, _, _ := unstructured.NestedString(setting.Object, "value")
	if value == "" {
		value, _, _ = unstructured.NestedString(setting.Object, "default")
	}
	if atLeast(value, 1, 8) {
		return BackendDeclarative, "Harvester server-version " + value + " >= v1.8"
	}
	return BackendSubresource, "Harvester server-version " + strconv.Quote(value) + " < v1.8"
}

// hotplugGates reads the two hotplug feature gates of a KubeVirt CR.
func hotplugGates(kv *kubevirtv1.KubeVirt) (legacy, declarative bool) {
	if dc := kv.Spec.Configuration.DeveloperConfiguration; dc != nil {
		for _, g := range dc.FeatureGates {
			switch g {
			case "DeclarativeHotplugVolumes":
				declarative = true
			case "HotplugVolumes":
				legacy = true
			}
		}
	}
	return legacy, declarative
}

// atLeast compares a "v1.8.0"-style version (pre-release suffixes allowed)
// with major.minor.
func atLeast(v string, major, minor int) bool {
	v = strings.TrimPrefix(strings.TrimSpace(v), "v")
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return false
	}
	minorDigits := strings.FieldsFunc(parts[1], func(r rune) bool { return r < '0' || r > '9' })
	if len(minorDigits) == 0 {
		return false
	}
	ma, err1 := strconv.Atoi(parts[0])
	mi, err2 := strconv.Atoi(minorDigits[0])
	if err1 != nil || err2 != nil {
		return false
	}
	return ma > major || (ma == major && mi >= minor)
}
