// Package opsserver is each role's operations endpoint: /metrics for
// Prometheus, /livez (the process answers) and /readyz (its dependencies
// answer and the pipeline is not stalled), for orchestrators and for
// `fanout healthcheck` in images without a shell, and /stages (the stage
// latencies of the last minute, as bucket counts) for `fanout status`.
package opsserver

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/fanout/fanout/internal/metrics"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Check is one readiness condition; it returns nil when satisfied.
type Check struct {
	Name string
	Fn   func(ctx context.Context) error
}

// Server serves the endpoints.
type Server struct {
	srv    *http.Server
	ln     net.Listener
	done   chan struct{}
	logger *slog.Logger
}

// checkTimeout bounds each readiness check.
const checkTimeout = 2 * time.Second

// Start listens on addr and serves until Shutdown.
func Start(addr string, reg *prometheus.Registry, checks []Check, logger *slog.Logger) (*Server, error) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte("ok\n"))
	})
	stages := metrics.StagesOf(reg)
	mux.HandleFunc("/stages", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(stages.LastMinute())
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		failures := Ready(r.Context(), checks)
		w.Header().Set("Content-Type", "application/json")
		if len(failures) > 0 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"ready": len(failures) == 0, "failures": failures})
	})
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	s := &Server{srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}, ln: ln, done: make(chan struct{}), logger: logger}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("operations endpoint", "error", err)
		}
	}()
	logger.Info("operations endpoint listening", "addr", ln.Addr().String(), "paths", "/metrics /livez /readyz /stages")
	return s, nil
}

// Addr is where the server listens.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Shutdown stops the server.
func (s *Server) Shutdown(ctx context.Context) error {
	err := s.srv.Shutdown(ctx)
	<-s.done
	return err
}

// Ready runs the checks concurrently and returns the failures by name.
func Ready(ctx context.Context, checks []Check) map[string]string {
	failures := map[string]string{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, c := range checks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cctx, cancel := context.WithTimeout(ctx, checkTimeout)
			defer cancel()
			if err := c.Fn(cctx); err != nil {
				mu.Lock()
				failures[c.Name] = err.Error()
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return failures
}
